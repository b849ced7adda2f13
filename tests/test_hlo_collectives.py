"""Reading collectives out of compiled HLO text, in every spelling the backends use.

The snippets are trimmed from real TPU / GPU compiles of this project's train step (shapes
shortened); each case is one spelling the counter must get right.
"""

import pathlib

from shardings.explain import count_collectives
from shardings.hlo import collectives, kernels

# tests/hlo/collectives.hlo: a scanned layer stack whose body runs 4 times. Inside it, a
# GPU-style async all-gather of two weights at once (a combined op), a TPU fused
# reduce-scatter, and an all-reduce over `model`. Outside, a permute and an all-to-all with
# list and iota replica groups. Before the loop, a splash kernel whose metadata string holds a
# newline (as TPU compiles print it): its continuation line starts with `}}`, which must not
# end the entry computation.
_HLO = (pathlib.Path(__file__).parent / "hlo" / "collectives.hlo").read_text()

MESH = {"data": 4, "model": 2}  # device id = 2 * data index + model index


def _by_name():
    return {c.name: c for c in collectives(_HLO, MESH)}


def test_loop_body_collectives_run_once_per_iteration():
    ops = _by_name()
    assert ops["all-gather-start"].executions == 4
    assert ops["fusion.5"].executions == 4
    assert ops["collective-permute.1"].executions == 1


def test_async_pairs_count_once_and_combined_ops_sum_their_outputs():
    ops = _by_name()
    assert "all-gather-done" not in ops and "all-to-all-done" not in ops
    gather = ops["all-gather-start"]
    assert gather.op == "all-gather"
    assert gather.array_bytes == (16 * 128 + 8 * 64) * 2  # both gathered outputs, bf16
    assert ops["all-to-all-start"].array_bytes == 8 * 2 * 128 * 8 * 2


def test_tpu_fused_reduce_scatter_is_one_reduce_scatter_of_the_whole_input():
    ops = _by_name()
    rs = ops["fusion.5"]
    assert rs.op == "reduce-scatter"
    assert rs.group_size == 8
    assert rs.array_bytes == 8 * 128 * 2 * 8  # the shard times the group
    # Its inner all-reduce is the fusion's implementation, not a second collective.
    assert "all-reduce.9" not in ops


# A TPU fused reduce-scatter names no replica groups on its fusion line: its groups are those
# of the all-reduce it calls (here over `model` only, as a tensor-parallel reduce-scatter
# inside a pipeline stage compiles for v5p).
_FUSED_OVER_MODEL = (pathlib.Path(__file__).parent / "hlo" / "fused_reduce_scatter.hlo").read_text()


def test_tpu_fused_reduce_scatter_takes_the_groups_of_its_all_reduce():
    (rs,) = collectives(_FUSED_OVER_MODEL, MESH)
    assert (rs.op, rs.axes, rs.group_size) == ("reduce-scatter", ("model",), 2)
    assert rs.array_bytes == 4 * 32 * 2 * 2


def test_replica_groups_map_to_the_mesh_axes_they_cross():
    ops = _by_name()
    assert ops["all-gather-start"].axes == ("data",)  # mesh form, axis_0 of 4 x 2
    assert ops["all-reduce.2"].axes == ("model",)  # listed pairs {2i, 2i+1}
    assert ops["collective-permute.1"].axes == ("data",)  # 0 -> 2 -> 4 -> 6: data steps
    # iota [2,4]<=[4,2]T(1,0): groups {0,2,4,6}, {1,3,5,7}: along data.
    assert ops["all-to-all-start"].axes == ("data",)
    assert ops["all-to-all-start"].group_size == 4
    # Mesh form with permuted device ids: position (i, j) holds device i + 4j, so the
    # groups over axis_1 are {i, i+4}: along data, though axis_1 has the size of model.
    assert ops["all-reduce.5"].axes == ("data",)
    assert ops["all-reduce.5"].group_size == 2


def test_bytes_per_device_follow_the_ring_algorithms():
    ops = _by_name()
    ar = ops["all-reduce.2"]  # 2 devices: each sends half, twice
    assert ar.bytes_per_device == 2 * (4 * 128 * 4) / 2
    permute = ops["collective-permute.1"]
    assert permute.bytes_per_device == 32 * 4


def test_count_collectives_counts_each_op_once_in_the_program_text():
    counts = count_collectives(_HLO)
    assert counts["all-gather"] == 1
    assert counts["reduce-scatter"] == 1
    assert counts["all-reduce"] == 2
    assert counts["all-to-all"] == 1
    assert counts["collective-permute"] == 1


def test_kernels_are_custom_call_targets():
    assert kernels(_HLO) == {"tpu_custom_call": 2}


def test_fp8_arrays_count_one_byte_and_each_op_names_its_dtypes():
    # An FSDP gather of an e4m3 weight (model.quantization=fp8), GPU's async spelling.
    fp8_gather = """ENTRY %main (p: f8e4m3fn[16,128]) -> f8e4m3fn[64,128] {
  %p = f8e4m3fn[16,128]{1,0} parameter(0)
  %all-gather-start.3 = (f8e4m3fn[16,128]{1,0}, f8e4m3fn[64,128]{1,0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %all-gather-done.3 = f8e4m3fn[64,128]{1,0} all-gather-done(%all-gather-start.3)
}
"""  # noqa: E501
    (gather,) = collectives(fp8_gather, {"data": 4})
    assert gather.array_bytes == 64 * 128 and gather.dtypes == ("f8e4m3fn",)
    assert _by_name()["all-gather-start"].dtypes == ("bf16",)


# all-reduce-start's result: the reduced value itself up to jax 0.10's XLA, alone or a
# combined op's tuple; newer XLA (jax 0.12's GPU compiles) wraps it as the other async starts:
# ((operands), results). Each is counted once, at the reduced arrays' size.
_ALL_REDUCE_STARTS = """HloModule m, entry_computation_layout={()->()}

ENTRY %main () -> () {
  %p = f32[128]{0} parameter(0)
  %q = f32[64]{0} parameter(1)
  %old = f32[128]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %old_done = f32[128]{0} all-reduce-done(%old)
  %combined = (f32[128]{0}, f32[64]{0}) all-reduce-start(%p, %q), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %combined_done = (f32[128]{0}, f32[64]{0}) all-reduce-done(%combined)
  %new = ((f32[128]{0}), f32[128]{0}) all-reduce-start(%p), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  %new_done = f32[128]{0} all-reduce-done(%new)
  ROOT %t = () tuple()
}
"""  # noqa: E501 -- HLO lines as XLA prints them


def test_all_reduce_start_counts_the_reduced_arrays_in_either_spelling():
    ops = {c.name: c for c in collectives(_ALL_REDUCE_STARTS, MESH)}
    assert {name: c.op for name, c in ops.items()} == dict.fromkeys(
        ("old", "combined", "new"), "all-reduce"
    )
    assert ops["old"].array_bytes == ops["new"].array_bytes == 128 * 4
    assert ops["combined"].array_bytes == (128 + 64) * 4
