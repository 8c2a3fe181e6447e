"""SAA's CUDA-style path (batched isend/irecv, run here on gloo) reports its all-to-all to the
event log, so Lina holds back gradient micro-ops while it is in flight."""

import torch

from megatron_moe.testing import spawn


def _p2p_events(rank, world):
    from megatron_moe.distributed.observer import CommLog as EventLog
    from megatron_moe.distributed.saa import a2a_combine_gather
    from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel

    ps = initialize_model_parallel(2, 2, 1)
    try:
        send = torch.full((2, 1, 6, 4), float(rank))  # [D=N_EP, E_l, N, M]
        with EventLog() as log:
            p2p = a2a_combine_gather(send, ps.group("ep_esp"), ps.group("mp"), 1, overlap=True, chunks=3, p2p=True)
        plain = a2a_combine_gather(send, ps.group("ep_esp"), ps.group("mp"), 1, overlap=True, chunks=3, p2p=False)
        a2a = [e for e in log.snapshot() if e.op == "all_to_all"]
        return torch.equal(p2p, plain), len(a2a), all(e.finish is not None and e.finish >= e.launch for e in a2a)
    finally:
        destroy_model_parallel()


def test_p2p_all_to_all_chunks_appear_in_the_event_log():
    for same, n_a2a, closed in spawn(_p2p_events, 4):
        assert same
        assert n_a2a == 3  # one interval per chunk, each closed by its wait
        assert closed
