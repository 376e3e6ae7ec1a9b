#!/usr/bin/env python3
"""Writes the scheduler fuzzer's seeds (tests/fuzz/corpus/scheduler): each a job
kind byte and messages, the headers written as text and encoded with protoc
(--encode=tessera.wire.Header). Run from anywhere: python3 tests/fuzz/make_scheduler_seeds.py
"""
import subprocess, struct, os
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
PROTO_DIR = os.path.join(ROOT, 'proto')
def enc(text):
    return subprocess.run(['protoc','--encode=tessera.wire.Header','-I',PROTO_DIR,'tessera.proto'],
                          input=text.encode(), capture_output=True, check=True).stdout
def reg(role, port, rank, gen=1, nonce=1, spare=False):
    return enc(f'command: REGISTER register {{ node {{ role: {role} host: "127.0.0.1" port: {port} rank: {rank} generation: {gen} }} hostname: "h" pid: {port} nonce: {nonce} spare: {"true" if spare else "false"} }}')
def hb(s): return enc(f'sender: {s} command: HEARTBEAT')
def barrier(s, rid): return enc(f'sender: {s} command: BARRIER request_id: {rid} barrier {{ group: 7 }}')
def ack(s, rid): return enc(f'sender: {s} command: NODE_TABLE is_response: true request_id: {rid}')
def done(s): return enc(f'sender: {s} command: WORKER_DONE request_id: 99')
def cmd(s, c, extra=''): return enc(f'sender: {s} command: {c} request_id: 5 {extra}')
def form(servers, workers):
    m=[reg('SERVER', 9000+i, i, nonce=10+i) for i in range(servers)]
    m+=[reg('WORKER', 9100+i, i, nonce=20+i) for i in range(workers)]
    return m
def seed(name, job, msgs):
    data=bytes([job])
    for m in msgs: data+=struct.pack('<H',len(m))+m
    open(os.path.join(ROOT, 'tests/fuzz/corpus/scheduler', name), 'wb').write(data)
ids=[8,10,9,11]
seed('plain_job_ends', 0, form(2,2)+[ack(i,1) for i in ids]+[hb(i) for i in ids]+[barrier(i,3) for i in ids]+[done(9),done(11)])
seed('plain_repeat_and_restart', 0, form(2,2)+[reg('WORKER',9100,0,nonce=20), reg('WORKER',9100,0,gen=2,nonce=21), reg('SERVER',9005,5,nonce=30)]+[hb(i) for i in ids])
rids=[8,10,12,9,11]
seed('replicated_leave_spare_handback', 1, form(3,2)+[ack(i,1) for i in rids]+[reg('SERVER',9010,-1,nonce=40,spare=True), cmd(8,'SERVER_LEAVE'), cmd(12,'CAUGHT_UP'), cmd(10,'HANDBACK','handback_rank: 0 handback_epoch: 1'), reg('SERVER',9001,1,gen=2,nonce=41), cmd(12,'HANDBACK','handback_rank: 1 handback_epoch: 1')])
seed('elastic_join_leave', 2, form(2,2)+[ack(i,1) for i in ids]+[reg('WORKER',9102,2,nonce=50), ack(13,1), cmd(9,'WORKER_LEAVE'), reg('WORKER',9100,0,gen=2,nonce=51), barrier(11,4), barrier(13,4), done(11), done(13)])
seed('one_copy_add_and_leave', 3, form(2,2)+[ack(i,1) for i in ids]+[reg('SERVER',9020,-1,nonce=60,spare=True), cmd(12,'CAUGHT_UP'), cmd(8,'HANDBACK','handback_rank: 1 handback_epoch: 1'), cmd(10,'SERVER_LEAVE'), cmd(8,'HANDBACK','handback_rank: 1 handback_epoch: 2 handback_leave: true')])
print(sorted(os.listdir(os.path.join(ROOT, 'tests/fuzz/corpus/scheduler'))))
