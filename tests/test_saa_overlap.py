"""SAA seen from the event log: in Parm S2, chunk i's MP all-gather is launched while chunk i+1's
return all-to-all is in flight (launched, not yet completed); with --no-moe-saa (AAS) never."""

from equivalence import MICRO_BATCH, global_batch, tiny_config
from megatron_moe.distributed import observer
from megatron_moe.distributed.observer import CommLog
from megatron_moe.distributed.saa import SAA_CHUNKS
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron_moe.testing import spawn

CHUNKS = SAA_CHUNKS  # the slot dim (8 slots per expert and MP rank here) splits into this many


def _overlapped(log: CommLog) -> tuple[int, int]:
    """(MP all-gathers launched while an all-to-all was in flight, MP all-gathers)."""
    gathers, a2as = [g for g in log.of("all_gather") if g.group == "mp"], log.of("all_to_all")
    return len(observer.launched_during(gathers, a2as)), len(gathers)


def _s2_steps(rank, world):
    """MP2 x EP2, schedule S2 with SAA, then AAS: one forward + backward each under the event log."""
    ps = initialize_model_parallel(2, 2, 1)
    try:
        ids, labels = global_batch(ps.size("dp"))
        mine = slice(ps.rank("dp") * MICRO_BATCH, (ps.rank("dp") + 1) * MICRO_BATCH)
        out = {}
        for saa in (True, False):
            model = GPT2MoE(tiny_config(schedule="s2", cf=2.0, moe_saa=saa), ps)
            with CommLog() as log:
                lm, aux = model(ids[mine], labels[mine])
                (lm + aux).backward()
            out[saa] = _overlapped(log)
        return out
    finally:
        destroy_model_parallel()


def test_s2_all_gather_of_chunk_i_starts_while_chunk_i_plus_1_all_to_all_is_in_flight():
    for res in spawn(_s2_steps, 4):
        overlapped, gathers = res[True]
        # forward and backward each run one SAA of CHUNKS chunks; every chunk but the last is
        # forwarded to the MP peers while the next chunk's all-to-all travels
        assert gathers == 2 * CHUNKS
        assert overlapped == 2 * (CHUNKS - 1), f"SAA: {overlapped} of {gathers} all-gathers overlapped"
        assert res[False] == (0, 2)  # AAS: one all-gather after each all-to-all completed
