from stabletrain.monitor import names as N


def test_metric_parse_round_trip_and_for_block():
    for name in ("sigma1/blocks.3/wq_t_wk_max", "sec/layers.1.blocks.0/s4", "entropy/blocks.11/head2"):
        p = N.parse(name)
        assert N.metric(p.group, p.block, p.quantity) == name
    assert N.parse("token_sim/blocks.3") == ("token_sim", "blocks.3", None)
    assert N.parse("attn_logit_max/layers.1.blocks.0") == ("attn_logit_max", "layers.1.blocks.0", None)
    assert N.parse("attn_logit_max/blocks.0/x") is None and N.parse(N.LOG_Z) is None
    for scalar in ("loss", "val/acc", "adamw2/frac_bounded", "adamw2/lr_eff/blocks.0.attn.qkv.weight"):
        assert N.parse(scalar) is None
    assert N.for_block("blocks.2", {"sigma1/wq": 1.0, "token_sim": 0.5}) == {
        "sigma1/blocks.2/wq": 1.0, "token_sim/blocks.2": 0.5}
    assert N.blocks_in(["sigma1/blocks.10/wq", "sigma1/blocks.9/wq", "loss"]) == ["blocks.9", "blocks.10"]


def test_fifteen_quantities_and_sec_sizes():
    assert len(N.FIFTEEN) == 15 and len(set(N.FIFTEEN)) == 15
    assert sum(q.quantity.endswith("_beta") for q in N.FIFTEEN) == 2  # 13 without norm biases
    assert N.sec_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert N.sec_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert N.sec_alert_size(64) == 4 and N.sec_alert_size(128) == 4 and N.sec_alert_size(32) == 2
    assert N.sec_alert_size(16) == 2 and N.sec_alert_size(4) == 2 and N.sec_alert_size(2) == 1
    assert N.sec_alert_size(48) == 2 and N.sec_alert_size(63) == 2 and N.sec_alert_size(47) == 2
    # the alert reads a logged point of the curve: otherwise it can never fire
    assert all(N.sec_alert_size(d) in N.sec_sizes(d) for d in range(2, 1025))
    assert N.adamw2_lr_eff("blocks.0.mlp.fc1.weight") == "adamw2/lr_eff/blocks.0.mlp.fc1.weight"
