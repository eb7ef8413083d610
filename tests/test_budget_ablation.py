"""bench/budget_ablation.py's variants: each undoes one kind of the mix's choices and nothing else."""

from bench.budget_ablation import BASE, variants


def test_each_variant_puts_one_kind_of_choice_back_to_w4_g64():
    mix = {"model.layers.0.self_attn.v_proj": "w8 g64", "model.layers.0.mlp.down_proj": "w3 g64",
           "model.layers.1.mlp.gate_proj": "w4 g128", "model.layers.1.self_attn.q_proj": "w4 g32"}
    got = variants(mix)
    assert got["mix"] == mix and got[f"uniform {BASE}"] == dict.fromkeys(mix, BASE)
    assert got[f"mix, 3-bit Linears -> {BASE}"] == {**mix, "model.layers.0.mlp.down_proj": BASE}
    assert got[f"mix, 8-bit Linears -> {BASE}"] == got[f"mix, v_proj -> {BASE}"] == {
        **mix, "model.layers.0.self_attn.v_proj": BASE}
    assert got[f"mix, MLP Linears -> {BASE}"] == {**mix, "model.layers.0.mlp.down_proj": BASE,
                                                 "model.layers.1.mlp.gate_proj": BASE}
    assert got[f"mix, attention Linears -> {BASE}"] == {**mix, "model.layers.0.self_attn.v_proj": BASE,
                                                       "model.layers.1.self_attn.q_proj": BASE}
