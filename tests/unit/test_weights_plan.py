"""The resharding plan (vllm_ext.transport.plan): trainer layout -> replica TP layout."""

from __future__ import annotations

import pytest

from vllm_ext.transport.plan import (Piece, TpRules, box_numel, check_cover, expert_groups, expert_members,
                                   fsdp_boxes, fsdp_owned, replica_needs, reshard, vllm_tp_box, wire_shapes)

SHAPES = {
    "model.embed_tokens.weight": (512, 128),
    "model.layers.0.self_attn.q_b_proj.weight": (384, 64),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (576, 128),
    "model.layers.0.self_attn.o_proj.weight": (128, 128),
    "model.layers.0.mlp.experts.3.down_proj.weight": (128, 32),
    "model.layers.0.input_layernorm.weight": (128,),
    "lm_head.weight": (500, 128),
}


def test_fsdp_boxes_follow_torch_chunk():
    assert fsdp_boxes((5, 3), 2) == [((0, 3), (0, 3)), ((3, 5), (0, 3))]
    assert fsdp_boxes((1, 4), 2) == [((0, 1), (0, 4)), None]


def test_tp_boxes_match_vllm_sharding():
    rules = TpRules()
    assert vllm_tp_box("model.layers.0.self_attn.q_b_proj.weight", (384, 64), 2, 1, rules) == ((192, 384), (0, 64))
    assert vllm_tp_box("model.layers.0.self_attn.o_proj.weight", (128, 96), 2, 1, rules) == ((0, 128), (48, 96))
    assert vllm_tp_box("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 128), 2, 1) == ((0, 576), (0, 128))
    # vocabulary blocks are cut from the padded vocab (64): 500 -> 512, 256 rows each, the last one short
    assert vllm_tp_box("lm_head.weight", (500, 128), 2, 1) == ((256, 500), (0, 128))
    # one kv head over TP 2: vLLM replicates k/v
    assert vllm_tp_box("model.layers.0.self_attn.k_proj.weight", (64, 128), 2, 0, TpRules(num_kv_heads=1)) \
        == ((0, 64), (0, 128))
    with pytest.raises(ValueError, match="does not split over TP 2"):
        vllm_tp_box("model.layers.0.mlp.down_proj.weight", (128, 33), 2, 0)


@pytest.mark.parametrize("world,tps", [(1, [1]), (2, [1, 2]), (4, [2, 1, 2])])
def test_plan_tiles_every_receiver_from_owners_only(world, tps):
    needs = [n for tp in tps for n in replica_needs(SHAPES, tp)]
    owned = fsdp_owned(SHAPES, world)
    pieces = reshard(list(SHAPES), owned, needs)
    for recv, need in enumerate(needs):
        assert check_cover([p for p in pieces if p.receiver == recv], need) is None
    for p in pieces:  # every piece lies inside a box its sender holds
        assert any(r == p.sender and all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(box, p.box))
                   for r, box in owned[p.name])
    # bytes: each receiver gets exactly its boxes, so the total is the sum of the needs
    assert sum(box_numel(p.box) for p in pieces) == sum(box_numel(b) for n in needs for b in n.values())


def test_replicated_ownership_is_spread_over_owners():
    shapes = {f"t{i}": (8, 8) for i in range(4)}
    owned = {n: [(0, ((0, 8), (0, 8))), (1, ((0, 8), (0, 8)))] for n in shapes}
    pieces = reshard(list(shapes), owned, replica_needs(shapes, 1))
    assert sorted(p.sender for p in pieces) == [0, 0, 1, 1]


def test_cover_check_names_what_is_wrong():
    need = {"a": ((0, 4), (0, 4))}
    assert "not covered" in check_cover([Piece("a", ((0, 2), (0, 4)), 0, 0)], need)
    assert "outside" in check_cover([Piece("a", ((0, 5), (0, 4)), 0, 0)], need)
    assert "overlaps" in check_cover([Piece("a", ((0, 4), (0, 4)), 0, 0), Piece("a", ((0, 2), (0, 4)), 1, 0)], need)
    assert "not a tensor" in check_cover([Piece("b", ((0, 1),), 0, 0)], need)
    assert Piece.from_json(Piece("a", ((0, 2), (1, 4)), 1, 0).to_json()) == Piece("a", ((0, 2), (1, 4)), 1, 0)


def _experts(n: int, layer: int = 1) -> dict[str, tuple[int, int]]:
    return {f"model.layers.{layer}.mlp.experts.{e}.{p}.weight": (128, 32) if p == "down_proj" else (32, 128)
            for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")}


def test_experts_travel_stacked_in_runs():
    shapes = {"model.embed_tokens.weight": (512, 128), **_experts(64), "lm_head.weight": (512, 128)}
    groups = expert_groups(shapes)  # 64 x 4096 elements fit one run
    assert list(groups) == ["model.embed_tokens.weight", "model.layers.1.mlp.experts.0-64.gate_proj.weight",
                            "model.layers.1.mlp.experts.0-64.up_proj.weight",
                            "model.layers.1.mlp.experts.0-64.down_proj.weight", "lm_head.weight"]
    stack = "model.layers.1.mlp.experts.0-64.down_proj.weight"
    assert groups[stack] == expert_members(stack) == [f"model.layers.1.mlp.experts.{e}.down_proj.weight"
                                                      for e in range(64)]
    assert wire_shapes(shapes, groups)[stack] == (64, 128, 32)
    assert expert_members("model.layers.1.mlp.experts.3.down_proj.weight") is None
    # runs of at most max_elems: 10 experts of 4096, the last run short
    runs = [g for g in expert_groups(shapes, max_elems=10 * 4096) if "gate_proj" in g]
    assert runs == [f"model.layers.1.mlp.experts.{a}-{min(a + 10, 64)}.gate_proj.weight" for a in range(0, 64, 10)]
    # an expert bigger than max_elems travels alone, under its own name
    assert expert_groups(shapes, max_elems=4095) == {n: [n] for n in shapes}


def test_experts_that_do_not_stack_travel_alone():
    gap = {n: s for n, s in _experts(4).items() if ".2.gate_proj" not in n}  # expert 2's gate missing
    groups = expert_groups(gap)
    assert [g for g in groups if "gate_proj" in g] == [f"model.layers.1.mlp.experts.{e}.gate_proj.weight"
                                                       for e in (0, 1, 3)]
    assert "model.layers.1.mlp.experts.0-4.up_proj.weight" in groups
    odd = {**_experts(4), "model.layers.1.mlp.experts.3.up_proj.weight": (16, 128)}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in expert_groups(odd)


def test_a_stack_is_cut_for_tp_like_each_of_its_experts():
    for name, shape in (("gate_proj", (32, 128)), ("down_proj", (128, 32))):
        one = vllm_tp_box(f"model.layers.1.mlp.experts.5.{name}.weight", shape, 2, 1)
        assert vllm_tp_box(f"model.layers.1.mlp.experts.4-8.{name}.weight", (4, *shape), 2, 1) == ((0, 4), *one)
