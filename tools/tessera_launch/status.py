"""launch.py --status: what a running job waits for, from every process's
GET /debug/pending (docs/debugging.md), in one summary.

    launch.py --status 127.0.0.1:9100    # the scheduler's metrics address
    launch.py --metrics-port 9100 --status

The scheduler's answer lists the nodes and their metrics addresses; each node
is asked in turn. Prints the oldest open round and whom it waits for, the
dist_ssp pull the staleness bound has held longest and whom it waits for, the
slowest worker, open barriers, requests in flight and held messages, and a
line for every process that did not answer. Exit status 0 when the scheduler
answered, 1 when it did not (nothing else can be found then).
"""

import http.client
import json
import urllib.error
import urllib.request

# What asking a process can raise: connection and HTTP errors, a cut-off or
# malformed answer.
FETCH_ERRORS = (OSError, ValueError, http.client.HTTPException)

# Seconds to wait for each process (the scheduler answers between messages).
FETCH_TIMEOUT = 5.0


def fetch(base, timeout=FETCH_TIMEOUT):
    """The /debug/pending JSON of the process serving metrics at `base`."""
    with urllib.request.urlopen(base.rstrip('/') + '/debug/pending', timeout=timeout) as r:
        return json.loads(r.read().decode('utf-8'))


def base_url(address):
    """'HOST:PORT' or an http:// URL (its /metrics path dropped) -> http://HOST:PORT."""
    address = address.strip()
    if not address.startswith('http://') and not address.startswith('https://'):
        address = 'http://' + address
    for suffix in ('/metrics', '/debug/pending', '/'):
        if address.endswith(suffix):
            address = address[:-len(suffix)]
    return address


def name_of(p):
    if p.get('role') == 'scheduler':
        return 'scheduler'
    return '%s %d (id %d, pid %s)' % (p.get('role', '?'), p.get('rank', -1), p.get('id', 0),
                                      p.get('pid', '?'))


def collect(address):
    """(scheduler's pending, [(node status, pending or None, error or None)])."""
    scheduler = fetch(base_url(address))
    nodes = []
    for n in scheduler.get('nodes', []):
        url = n.get('metrics_url', '')
        if not url:
            nodes.append((n, None, 'serves no metrics (TESSERA_METRICS_PORT unset)'))
            continue
        try:
            nodes.append((n, fetch(url), None))
        except FETCH_ERRORS as e:
            nodes.append((n, None, 'no answer from %s: %s' % (url, e)))
    return scheduler, nodes


def describe_rank(nodes, rank):
    for n, _, _ in nodes:
        if n.get('role') == 'worker' and n.get('rank') == rank:
            return 'worker %d (id %d at %s:%d)' % (rank, n['id'], n['host'], n['port'])
    return 'worker %d' % rank


def summarize(scheduler, nodes):
    """The summary's lines."""
    lines = []
    servers = [x for x in nodes if x[0].get('role') == 'server']
    workers = [x for x in nodes if x[0].get('role') == 'worker']
    lines.append('job: %d server(s), %d worker(s); scheduler pid %s at %s'
                 % (len(servers), len(workers), scheduler.get('pid'), scheduler.get('host')))
    # The oldest open round of any server, and whom it waits for.
    rounds = []
    for n, p, _ in servers:
        for r in (p or {}).get('open_rounds', []):
            rounds.append((r.get('age_s', 0.0), n, r))
    if rounds:
        age, n, r = max(rounds, key=lambda x: x[0])
        missing = r.get('ranks_missing', [])
        lines.append('oldest round: key %s on server %d, open %.3f s, waits for %s (ranks in: %s)'
                     % (r.get('key'), n.get('rank'), age,
                        ', '.join(describe_rank(nodes, m) for m in missing) or 'nobody',
                        ', '.join(str(i) for i in r.get('ranks_in', [])) or 'none'))
    else:
        lines.append('oldest round: none open')
    # The dist_ssp pull held longest by the staleness bound, and whom it
    # waits for.
    held = []
    for n, p, _ in servers:
        for h in (p or {}).get('held_pulls', []):
            held.append((h.get('age_s', 0.0), n, h))
    if held:
        age, n, h = max(held, key=lambda x: x[0])
        steps = int(h.get('steps', 0))
        lines.append('oldest held pull: key %s on server %d, rank %d\'s %s at clock %s, held '
                     '%.3f s, waits for %s (%d step(s) short: %s of its pushes taken, '
                     'the bound s = %d needs %d)'
                     % (h.get('key'), n.get('rank'), h.get('rank', -1), h.get('command'),
                        h.get('clock'), age, describe_rank(nodes, h.get('held_by', -1)), steps,
                        h.get('held_by_pushes'), h.get('staleness', 0),
                        int(h.get('held_by_pushes', 0)) + steps))
    # The slowest worker: the largest mean arrival lag any server reports.
    lags = []
    for n, p, _ in servers:
        for lag in (p or {}).get('rank_lag', []):
            lags.append((lag.get('mean_lag_s', 0.0), lag.get('rank'), n.get('rank'),
                         int(lag.get('rounds', 0))))
    if lags:
        mean, rank, server, count = max(lags)
        lines.append('slowest worker: %s, mean arrival lag %.3f s over %d round(s) on server %d'
                     % (describe_rank(nodes, rank), mean, count, server))
    for b in scheduler.get('barriers', []):
        lines.append('open barrier of the %s%s: %.3f s, waits for %s'
                     % (b.get('group'), " ('%s')" % b['tag'] if b.get('tag') else '',
                        b.get('age_s', 0.0), ', '.join(b.get('missing', [])) or 'nobody'))
    for n, p, err in nodes:
        if err is not None:
            lines.append('%s %d (id %d at %s:%d): %s' % (n.get('role'), n.get('rank', -1),
                                                         n.get('id', 0), n.get('host'),
                                                         n.get('port', 0), err))
            continue
        parts = []
        requests = p.get('requests', [])
        if requests:
            oldest = max(requests, key=lambda r: r.get('age_s', 0.0))
            parts.append('%d request(s) in flight, oldest %s of key %s to %s for %.3f s '
                         '(%d resend(s))' % (p.get('requests_total', len(requests)),
                                             oldest.get('command'),
                                             oldest.get('key'), oldest.get('server_name'),
                                             oldest.get('age_s', 0.0),
                                             oldest.get('resends', 0)))
        if p.get('open_rounds'):
            parts.append('%d open round(s)' % p.get('open_rounds_total',
                                                   len(p['open_rounds'])))
        if p.get('held_pulls'):
            parts.append('%d dist_ssp pull(s) held by the bound'
                         % p.get('held_pulls_total', len(p['held_pulls'])))
        held = sum(w.get('count', 0) for w in p.get('waiting', []))
        if held:
            slices = p.get('waiting_total', len(p.get('waiting', [])))
            listed = len(p.get('waiting', []))
            parts.append('%d held message(s)%s' % (
                held, '' if slices <= listed else ' in the %d fullest of %d key slices'
                % (listed, slices)))
        busy = [t for t in p.get('threads', []) if t.get('phase') != 'idle']
        for t in busy:
            what = t.get('phase')
            if t.get('phase') != 'checkpoint':
                what = '%s of key %s' % (what, t.get('key'))
            parts.append('%s in %s for %.3f s' % (t.get('thread'), what, t.get('for_s', 0.0)))
        lines.append('%s: %s' % (name_of(p), '; '.join(parts) if parts else 'nothing pending'))
    return lines


def main(address, out):
    """Prints the summary of the job whose scheduler serves metrics at `address`."""
    try:
        scheduler, nodes = collect(address)
    except FETCH_ERRORS as e:
        out.write('launch.py --status: no answer from the scheduler at %s: %s\n'
                  % (base_url(address), e))
        return 1
    for line in summarize(scheduler, nodes):
        out.write(line + '\n')
    return 0
