#!/usr/bin/env python3
"""Runs clang's thread-safety analysis over every C and C++ file of a build.

  tools/thread_safety_check.py BUILD_DIR [-j N]

BUILD_DIR is configured with clang and -DTESSERA_THREAD_SAFETY=ON
-DCMAKE_EXPORT_COMPILE_COMMANDS=ON (tools/test.sh does it) and has its generated
headers (the target tessera_proto). Each file of BUILD_DIR/compile_commands.json is
compiled as its build would, with -fsyntax-only: the analysis is clang's front end, so
no code is generated and nothing is linked, which is most of what a full build of the
tree costs. Every ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED is a checked claim
(-Wthread-safety -Werror=thread-safety, with the build's other warnings as errors).
Prints the diagnostics of each failing file and exits 1 if any failed.
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys
import time


def syntax_only(entry):
    """The entry's command with -fsyntax-only in place of its output."""
    args = entry['arguments'] if 'arguments' in entry else shlex.split(entry['command'])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == '-o':
            skip = True
            continue
        out.append(a)
    return out + ['-fsyntax-only']


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('build')
    parser.add_argument('-j', type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    path = os.path.join(args.build, 'compile_commands.json')
    try:
        with open(path) as f:
            entries = json.load(f)
    except OSError as e:
        sys.exit('thread_safety_check: cannot read %s (%s): configure the build with '
                 '-DCMAKE_EXPORT_COMPILE_COMMANDS=ON' % (path, e.strerror))
    # .cxx: a unity build's batches (CMAKE_UNITY_BUILD), each including its sources.
    entries = [e for e in entries if e['file'].endswith(('.c', '.cc', '.cpp', '.cxx'))]
    if not entries:
        sys.exit('thread_safety_check: %s lists no C or C++ file' % path)
    command = syntax_only(entries[0])[0]
    if 'clang' not in os.path.basename(command):
        sys.exit('thread_safety_check: %s compiles with %s, not clang' % (path, command))

    def check(entry):
        r = subprocess.run(syntax_only(entry), cwd=entry['directory'],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return entry['file'], r.returncode, r.stdout

    start = time.monotonic()
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        for name, code, output in pool.map(check, entries):
            if code != 0 or output.strip():
                sys.stdout.write(output)
            if code != 0:
                failed.append(name)
    took = time.monotonic() - start
    if failed:
        print('thread_safety_check: %d of %d files failed (%.0f s): %s'
              % (len(failed), len(entries), took, ', '.join(failed)))
        return 1
    print('thread_safety_check: %d files checked, none failed (%.0f s)'
          % (len(entries), took))
    return 0


if __name__ == '__main__':
    sys.exit(main())
