"""The CUDA-graph bookkeeping that runs on the host: sizes, buckets, which steps replay, and the
padding of a live batch into a captured one (testable on the CPU; capture itself needs a GPU)."""

from __future__ import annotations

import numpy as np
import torch

from backboard.worker.cuda_graph import StaticBatch, bucket, capture_sizes, uniform_shape
from backboard.worker.input_batch import BatchRequest, prepare_batch


def test_capture_sizes_and_buckets():
    s = capture_sizes(256, 64, 1)
    assert s[:4] == [1, 2, 4, 8] and s[-1] == 64 and all(b <= 64 for b in s)
    s4 = capture_sizes(256, 64, 4)                      # verify rows: B * 4 <= 256
    assert max(s4) * 4 <= 256 and max(s4) == 64
    assert capture_sizes(256, 256, 1)[-1] == 256
    assert bucket(s, 3) == 4 and bucket(s, 8) == 8 and bucket(s, 9) == 16 and bucket(s, 65) is None


def _batch(specs):
    reqs = [BatchRequest(np.array(t), nc, list(range(8 * i, 8 * i + 4)), 10 + i, dst)
            for i, (t, nc, dst) in enumerate(specs)]
    return prepare_batch(reqs, block_size=4)


def test_only_uniform_steps_replay():
    assert uniform_shape(_batch([([1], 5, None), ([2], 7, None)]).meta) == (2, 1)
    assert uniform_shape(_batch([([1, 2, 3], 5, [10, 20, 21]), ([4, 5, 6], 6, [11, 22, 23])]).meta) == (2, 3)
    assert uniform_shape(_batch([([1], 5, None), ([1, 2, 3], 0, None)]).meta) is None      # a prefill
    assert uniform_shape(_batch([([1], 5, None), ([1, 2], 6, [11, 30])]).meta) is None     # two groups


def test_steps_from_an_empty_state_do_not_replay():
    from backboard.worker.cuda_graph import CudaGraphRunner

    g = CudaGraphRunner.__new__(CudaGraphRunner)
    g.sizes = {1: [1, 2, 4]}
    assert g.can_run(_batch([([1], 5, None), ([2], 7, None)]).meta)
    assert not g.can_run(_batch([([1], 5, None), ([2], 0, None)]).meta)   # a one-token prompt
    assert not g.can_run(_batch([([1], 5, None)] * 5).meta)                # larger than captured


def test_fill_pads_onto_scratch_block_and_slot():
    pb = _batch([([1, 2, 3], 5, [10, 20, 21]), ([4, 5, 6], 6, [11, 22, 23])])
    sb = StaticBatch.allocate(4, 3, max_blocks=6, max_seq_len=24, device="cpu")
    sb.fill(pb.input_ids, pb.meta, scratch_block=99, scratch_slot=77, block_size=4)
    assert sb.input_ids[:6].tolist() == pb.input_ids.tolist() and sb.input_ids[6:].eq(0).all()
    assert torch.equal(sb.slot_mapping[:6], pb.meta.slot_mapping)
    assert sb.slot_mapping[6:].eq(99 * 4).all()                 # padding KV goes to the scratch block
    assert sb.block_table[2:].eq(99).all() and sb.block_table[:2, pb.meta.block_table.shape[1]:].eq(99).all()
    assert sb.state_slots.tolist() == [10, 11, 77, 77] and sb.has_init.tolist() == [True, True, False, False]
    assert sb.dst_slots[:2].tolist() == [[10, 20, 21], [11, 22, 23]] and sb.dst_slots[2:].eq(77).all()
    assert sb.seq_lens.tolist() == [8, 9, 3, 3]                # padding: just its own rows
    # the captured metadata says "one group of B x L" and the longest context
    assert sb.meta.groups[0].num_reqs == 4 and sb.meta.groups[0].L == 3 and sb.meta.seq_lens_cpu.max() == 24


def test_runner_uses_no_graphs_on_cpu(hybrid_model):
    from backboard import LLM

    llm = LLM(hybrid_model, max_model_len=64, max_num_seqs=2)
    assert llm.engine.runner.graphs is None
