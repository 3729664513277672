"""init_weights from another code base's GPT: nanoGPT's ckpt.pt and Hugging Face's GPT-2 (its
Conv1D weights transposed, safetensors, config.json) load under this GPT's names, and the model
computes the function the source's tensors define, checked against GPT-2's forward written out
here from its tensors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from stabletrain.config import Components
from stabletrain.errors import ConfigError
from stabletrain.models.registry import build_model
from stabletrain.models.weights import load_weights
from tests.helpers import make_cfg

L, D, H, V, T = 2, 32, 4, 256, 40  # layers, width, heads, vocabulary, positions of the source


def _nanogpt_state(seed: int = 0, hidden: int = 4 * D) -> dict[str, torch.Tensor]:
    """A GPT-2 of nanoGPT's names (bias=True), random: gains and biases away from 1 and 0."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, mean=0.0):
        return mean + 0.3 * torch.randn(*shape, generator=g)

    sd = {"transformer.wte.weight": r(V, D), "transformer.wpe.weight": r(T, D),
          "transformer.ln_f.weight": r(D, mean=1.0), "transformer.ln_f.bias": r(D)}
    for i in range(L):
        p = f"transformer.h.{i}."
        sd |= {p + "ln_1.weight": r(D, mean=1.0), p + "ln_1.bias": r(D),
               p + "attn.c_attn.weight": r(3 * D, D), p + "attn.c_attn.bias": r(3 * D),
               p + "attn.c_proj.weight": r(D, D), p + "attn.c_proj.bias": r(D),
               p + "ln_2.weight": r(D, mean=1.0), p + "ln_2.bias": r(D),
               p + "mlp.c_fc.weight": r(hidden, D), p + "mlp.c_fc.bias": r(hidden),
               p + "mlp.c_proj.weight": r(D, hidden), p + "mlp.c_proj.bias": r(D)}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def _reference_logits(sd: dict, idx: torch.Tensor, gelu: str) -> torch.Tensor:
    """GPT-2's forward from its tensors (nanoGPT's names, (out, in) weights), with the causal
    softmax written out: pre-norm blocks, LayerNorm eps 1e-5, tied output layer."""
    def ln(x, name):
        return F.layer_norm(x, (D,), sd[name + ".weight"], sd[name + ".bias"], 1e-5)

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    b, t = idx.shape
    hd = D // H
    x = sd["transformer.wte.weight"][idx] + sd["transformer.wpe.weight"][:t]
    causal = torch.ones(t, t).tril().bool()
    for i in range(L):
        p = f"transformer.h.{i}."
        q, k, v = lin(ln(x, p + "ln_1"), p + "attn.c_attn").split(D, dim=-1)
        q, k, v = (z.view(b, t, H, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(hd)).masked_fill(~causal, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D)
        x = x + lin(y, p + "attn.c_proj")
        x = x + lin(F.gelu(lin(ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate=gelu), p + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ sd["transformer.wte.weight"].T


def _hf_state(sd: dict, prefix: str = "transformer.") -> dict:
    """The same GPT-2 as Hugging Face stores it: Conv1D weights (in, out), the causal mask as a
    buffer per block, the tied lm_head left out (as its safetensors file does)."""
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue
        conv1d = k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        out[prefix + k.removeprefix("transformer.")] = v.t().contiguous() if conv1d else v.clone()
    for i in range(L):
        out[f"{prefix}h.{i}.attn.bias"] = torch.ones(1, 1, T, T).tril()
        out[f"{prefix}h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def _gpt(*over: str):
    cfg = make_cfg("model=gpt_test", f"model.embed_dim={D}", f"model.depth={L}", f"model.num_heads={H}",
                   f"model.vocab_size={V}", "model.bias=true", *over)
    torch.manual_seed(7)
    return build_model(cfg.model, Components.of(cfg)).eval(), cfg.model


def _idx(t: int = 24):
    return torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(3))


def test_a_nanogpt_checkpoint_loads_with_its_function(tmp_path):
    """nanoGPT's ckpt.pt (a compiled model's _orig_mod. names, model_args, iter_num), found in its
    out_dir: every tensor loads, and the GPT computes the reference forward."""
    sd = _nanogpt_state()
    # dropout 0.1 there, 0 here: a training setting, the same function, so not named
    args = {"n_layer": L, "n_head": H, "n_embd": D, "block_size": T, "bias": True, "vocab_size": V, "dropout": 0.1}
    torch.save({"model": {"_orig_mod." + k: v for k, v in sd.items()}, "model_args": args, "iter_num": 5000,
                "best_val_loss": torch.tensor(2.5), "config": {"batch_size": 12}}, tmp_path / "ckpt.pt")
    model, m = _gpt(f"model.block_size={T}")
    note = load_weights(model, tmp_path, m)
    assert note.startswith("init_weights: 29 of the model's 29 " \
        f"tensors from {tmp_path / 'ckpt.pt'} (nanoGPT's tensors); "
                           "the optimizer"), note
    with torch.no_grad():
        torch.testing.assert_close(model(_idx()), _reference_logits(sd, _idx(), "none"), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix", ["transformer.", ""])  # GPT2LMHeadModel's, GPT2Model's
def test_hugging_face_gpt2_loads_with_its_function(tmp_path, prefix):
    """model.safetensors and config.json in a Hugging Face model folder: the Conv1D weights are
    transposed, the mask buffers dropped, the tied output layer taken from wte; GPT-2's tanh GELU
    is model.act=gelu_tanh, and the note says when this model's activation is another."""
    from safetensors.torch import save_file

    sd = _nanogpt_state(seed=1)
    save_file(_hf_state(sd, prefix), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": L, "n_head": H, "n_embd": D,
                                                      "n_positions": T, "vocab_size": V,
                                                      "activation_function": "gelu_new"}))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    note = load_weights(model, tmp_path, m)
    assert "29 of the model's 29 " \
        f"tensors from {tmp_path / 'model.safetensors'} (Hugging Face GPT-2's tensors, its Conv1D " \
           "weights transposed)" in note and "unused" not in note and "had" not in note, note
    with torch.no_grad():
        torch.testing.assert_close(model(_idx()), _reference_logits(sd, _idx(), "tanh"), rtol=1e-4, atol=1e-4)
    model, m = _gpt(f"model.block_size={T}")
    note = load_weights(model, tmp_path, m)
    assert "; the source's model had model.act=gelu_tanh (this run: gelu): the weights load, the function they " \
           "compute here is another;" in note, note


def test_a_longer_context_is_cut_to_block_size_with_the_function_of_what_fits(tmp_path):
    """nanoGPT's crop_block_size: the first block_size positions; any sequence that fits is
    computed as the source computes it."""
    sd = _nanogpt_state(seed=2)
    torch.save(sd, tmp_path / "w.pt")
    model, m = _gpt("model.block_size=16")
    note = load_weights(model, tmp_path / "w.pt", m)
    assert "(nanoGPT's tensors; its first 16 of 40 positions)" in note and "had" not in note, note
    with torch.no_grad():
        torch.testing.assert_close(model(_idx(16)), _reference_logits(sd, _idx(16), "none"), rtol=1e-4, atol=1e-4)


def test_another_vocabulary_or_a_shorter_context_is_refused_with_the_setting_that_fits(tmp_path):
    """Rows of wte are tokens: a source of another vocabulary would keep this model's
    initialisation for its embedding (and output layer), a fine-tune of nothing."""
    torch.save(_nanogpt_state(), tmp_path / "w.pt")
    model, m = _gpt("model.vocab_size=128", f"model.block_size={T}")
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / "w.pt", m)
    assert str(e.value) == (f"init_weights={tmp_path / 'w.pt'}: it has a vocabulary of {V} tokens (wte.weight; "
                            f"model.vocab_size=128 here); set model.vocab_size={V}")
    model, m = _gpt("model.vocab_size=512", f"model.block_size={T}")  # larger: wte would keep its init as well
    with pytest.raises(ConfigError, match=f"a vocabulary of {V} tokens .* set model.vocab_size={V}$"):
        load_weights(model, tmp_path / "w.pt", m)
    model, m = _gpt("model.block_size=64")
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / "w.pt", m)
    assert str(e.value) == (f"init_weights={tmp_path / 'w.pt'}: it has {T} positions (wpe.weight; model.block_size=64 "
                            f"here); set model.block_size={T} (or less)")


def test_gpt2s_weights_into_the_gpt2_s_preset_are_refused_with_every_setting_they_need(tmp_path):
    """model=gpt2_s pads the vocabulary to 50304 and has no biases (nanoGPT's choices); GPT-2's
    released weights need 50257 tokens, biases and the tanh GELU: one line names all three, where
    a first fix would have loaded the weights with their biases dropped, a function of nothing."""
    from safetensors.torch import save_file

    save_file(_hf_state(_nanogpt_state()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": D, "n_positions": T,
                                                      "vocab_size": V, "activation_function": "gelu_new"}))
    model, m = _gpt("model.vocab_size=320", "model.bias=false", "model.block_size=64")
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path, m)
    assert str(e.value) == (
        f"init_weights={tmp_path / 'model.safetensors'}: it has a vocabulary of {V} tokens (wte.weight; "
        f"model.vocab_size=320 here) and {T} positions (wpe.weight; model.block_size=64 here) and biases in its "
        f"layers (model.bias=false here); set model.vocab_size={V} model.block_size={T} (or less) model.bias=true "
        "(and model.act=gelu_tanh, its activation)")


def test_settings_that_change_the_function_but_no_shape_are_named(tmp_path):
    """num_heads splits the same qkv weight otherwise: nanoGPT's model_args (and a run's own
    config) say what the source was, and the note says this model differs."""
    sd = _nanogpt_state()
    args = {"n_layer": L, "n_head": 2, "n_embd": D, "block_size": T, "bias": True, "vocab_size": V}
    torch.save({"model": sd, "model_args": args}, tmp_path / "ckpt.pt")
    model, m = _gpt(f"model.block_size={T}")
    note = load_weights(model, tmp_path / "ckpt.pt", m)
    assert "the source's model had model.num_heads=2 (this run: 4): the weights load" in note, note
    # a run of this framework: its config.yaml's model group
    from tests.helpers import train

    base = ["model=gpt_test", "batch_size=4", "steps=1", "monitor=off"]
    train(tmp_path / "run", *base, "model.num_heads=4", "model.dropout=0.1")
    model, m = _gpt("model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.vocab_size=256",
                    "model.bias=false", "model.block_size=32")
    note = load_weights(model, tmp_path / "run", m)
    assert "the source's model had model.num_heads=4 (this run: 2): the" in note, note
    assert "16 of the model's 16" in note, note
    # and dropout (0.1 there, 0 here) trains, it computes the same function: not named


def test_a_run_starts_from_a_nanogpt_out_dir(tmp_path, capsys):
    """train.py with init_weights=<nanoGPT's out_dir>: the start line says what came over."""
    from tests.helpers import train

    sd = _nanogpt_state()
    torch.save({"model": sd, "model_args": {"n_layer": L, "n_head": H, "n_embd": D, "vocab_size": V,
                                            "block_size": T, "bias": True}, "iter_num": 600000},
               tmp_path / "ckpt.pt")
    s = train(tmp_path / "run", "model=gpt_test", f"model.embed_dim={D}", f"model.num_heads={H}",
              f"model.vocab_size={V}", "model.bias=true", "model.block_size=32", "batch_size=4", "steps=2",
              "monitor=off", f"init_weights={tmp_path}", quiet=False)
    assert s["status"] == "completed"
    err = capsys.readouterr().err
    assert ("init_weights: 29 of the model's 29 " \
        f"tensors from {tmp_path / 'ckpt.pt'} (nanoGPT's tensors; its first 32 of 40 "
            "positions); the optimizer, schedule and step count start afresh") in err, err


def test_an_older_hugging_face_folder_of_pytorch_model_bin_loads_with_its_function(tmp_path):
    """pytorch_model.bin of GPT2Model's names (as gpt2's on the Hub), its mask buffers in it, and a
    config.json that leaves out activation_function: Hugging Face's default, gelu_new, is the source's."""
    sd = _nanogpt_state(seed=3)
    torch.save(_hf_state(sd, prefix=""), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": L, "n_head": H, "n_embd": D,
                                                      "n_positions": T, "vocab_size": V}))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    note = load_weights(model, tmp_path, m)
    assert "29 of the model's 29 " \
        f"tensors from {tmp_path / 'pytorch_model.bin'} (Hugging Face" in note and "had" not in note, note
    with torch.no_grad():
        torch.testing.assert_close(model(_idx()), _reference_logits(sd, _idx(), "tanh"), rtol=1e-4, atol=1e-4)
    model, m = _gpt(f"model.block_size={T}")
    assert "had model.act=gelu_tanh (this run: gelu)" in load_weights(model, tmp_path, m)


def test_what_the_source_does_not_state_is_not_named_and_what_its_tensors_show_is(tmp_path):
    """A bare state dict of nanoGPT's names states no activation; Hugging Face's config.json no bias,
    but its tensors have them: a GPT of model.bias=false (the default) would drop them, and is refused."""
    torch.save(_nanogpt_state(), tmp_path / "w.pt")
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    assert "had" not in load_weights(model, tmp_path / "w.pt", m)
    from safetensors.torch import save_file

    save_file(_hf_state(_nanogpt_state()), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": D, "n_positions": T,
                                                      "vocab_size": V, "activation_function": "gelu_new"}))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh", "model.bias=false")
    with pytest.raises(ConfigError, match=r"it has biases in its layers \(model.bias=false here\); "
                                          r"set model.bias=true$"):
        load_weights(model, tmp_path, m)


def test_a_source_of_another_width_is_refused_with_its_setting(tmp_path):
    """Most tensors of another shape: the refusal says which model.* setting the source had."""
    args = {"n_layer": L, "n_head": H, "n_embd": D, "block_size": T, "bias": True, "vocab_size": V}
    torch.save({"model": _nanogpt_state(), "model_args": args}, tmp_path / "ckpt.pt")
    model, m = _gpt(f"model.block_size={T}", "model.embed_dim=64")
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path, m)
    assert str(e.value).endswith("; set what the source's model had: model.embed_dim=32 (this run: 64)"), e.value


def test_an_untied_output_layer_is_left_out_and_said(tmp_path):
    """This GPT ties lm_head to wte: of a source's two matrices, wte loads and the note says so
    (loading both would keep whichever loaded last)."""
    sd = _nanogpt_state()
    sd["lm_head.weight"] = 2 * sd["transformer.wte.weight"]
    torch.save(sd, tmp_path / "w.pt")
    model, m = _gpt(f"model.block_size={T}")
    note = load_weights(model, tmp_path / "w.pt", m)
    assert "(nanoGPT's tensors; its untied lm_head.weight left out: this GPT's output layer is its wte.weight)" \
        in note, note
    assert torch.equal(model.wte.weight, sd["transformer.wte.weight"]) and model.lm_head.weight is model.wte.weight


def test_hugging_faces_n_inner_is_model_mlp_hidden(tmp_path):
    """config.json's n_inner (the MLP's width, null for 4 x n_embd) is named as model.mlp_hidden where
    the MLP's tensors keep their initialisation: the setting that would load them."""
    from safetensors.torch import save_file

    save_file(_hf_state(_nanogpt_state(hidden=64)), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": D, "n_positions": T,
                                                      "n_inner": 64, "vocab_size": V}))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    note = load_weights(model, tmp_path, m)
    assert "6 kept their initialisation: blocks.0.mlp.fc1.weight ((128, 32) here, (64, 32) there)" in note, note
    assert " ... (the source's model had model.mlp_hidden=64 (this run: null));" in note, note
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh", "model.mlp_hidden=64")
    note = load_weights(model, tmp_path, m)
    assert "29 of the model's 29" in note and "had" not in note, note


def test_export_says_the_iteration_of_a_nanogpt_checkpoint(tmp_path, capsys):
    """scripts/export_weights.py of nanoGPT's out_dir: its iter_num is the step the line names."""
    from scripts.export_weights import main

    torch.save({"model": _nanogpt_state(), "iter_num": 5000, "config": {"batch_size": 12}}, tmp_path / "ckpt.pt")
    assert main([str(tmp_path), str(tmp_path / "w.pt")]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote {tmp_path / 'w.pt'}: the weights of {tmp_path / 'ckpt.pt'} "
                                               "(at step 5000), 29 tensors")


def test_a_runs_own_checkpoint_comes_before_a_nanogpt_one_in_the_same_folder(tmp_path):
    """hydra.run.dir=out (nanoGPT's out_dir) puts a run's checkpoints/ beside nanoGPT's ckpt.pt:
    init_weights=out reads the run's, the newer."""
    torch.save(_nanogpt_state(), tmp_path / "ckpt.pt")
    (tmp_path / "checkpoints").mkdir()
    torch.save(_nanogpt_state(seed=1), tmp_path / "checkpoints" / "last.pt")
    model, m = _gpt(f"model.block_size={T}")
    assert f"from {tmp_path / 'checkpoints' / 'last.pt'} " in load_weights(model, tmp_path, m)


def _shard(state: dict, folder, name: str, parts: int = 3) -> dict:
    """``state`` saved as Hugging Face saves a large model: ``parts`` files and an index naming each
    tensor's file; returns the weight map."""
    from safetensors.torch import save_file

    keys, stem, ext = sorted(state), *name.rsplit(".", 1)
    weight_map = {}
    for i in range(parts):
        file = f"{stem}-{i + 1:05d}-of-{parts:05d}.{ext}"
        chunk = {k: state[k] for k in keys[i::parts]}
        save_file(chunk, str(folder / file)) if ext == "safetensors" else torch.save(chunk, folder / file)
        weight_map |= dict.fromkeys(chunk, file)
    (folder / f"{name}.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_hugging_face_folder_of_sharded_weights_loads_whole_with_its_function(tmp_path, name):
    """A model saved in shards (model-0000N-of-0000M.safetensors and its index.json): the folder, or
    any one of its shards, reads every shard the index names; a missing shard is named."""
    sd = _nanogpt_state(seed=4)
    weight_map = _shard(_hf_state(sd), tmp_path, name)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": L, "n_head": H, "n_embd": D, "n_positions": T,
                                                      "vocab_size": V}))
    index = tmp_path / f"{name}.index.json"
    for source in (tmp_path, tmp_path / sorted(set(weight_map.values()))[1]):
        model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
        note = load_weights(model, source, m)
        assert "29 of the model's 29 " \
            f"tensors from {index} (Hugging Face GPT-2's tensors" in note and "had" not in note, note
        with torch.no_grad():
            torch.testing.assert_close(model(_idx()), _reference_logits(sd, _idx(), "tanh"), rtol=1e-4, atol=1e-4)
    gone = sorted(set(weight_map.values()))[2]
    (tmp_path / gone).unlink()
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path, m)
    assert str(e.value) == (f"init_weights={index}: 1 of the 3 files its weight_map names are not in {tmp_path} "
                            f"({gone}); download the whole folder")
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError, match=r"not an index of weight files \(no weight_map\); download it again$"):
        load_weights(model, tmp_path, m)


def test_hugging_face_options_this_gpt_does_not_have_are_named(tmp_path):
    """config.json's layer_norm_epsilon, scale_attn_weights and scale_attn_by_inverse_layer_idx change
    GPT-2's function and have no setting here: the weights load, and the note says which differ."""
    from safetensors.torch import save_file

    save_file(_hf_state(_nanogpt_state()), str(tmp_path / "model.safetensors"))
    said = {"n_layer": L, "n_head": H, "n_embd": D, "n_positions": T, "vocab_size": V}
    (tmp_path / "config.json").write_text(json.dumps({**said, "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
                                                      "scale_attn_by_inverse_layer_idx": False}))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    assert "another" not in load_weights(model, tmp_path, m)  # GPT-2's own values: this GPT's function
    (tmp_path / "config.json").write_text(json.dumps({**said, "layer_norm_epsilon": 1e-6,
                                                      "scale_attn_by_inverse_layer_idx": True}))
    note = load_weights(model, tmp_path, m)
    assert ("transposed; its config.json's layer_norm_epsilon=1e-06 and scale_attn_by_inverse_layer_idx=true, which "
            "this GPT does not have (1e-05 and false here): the function they compute here is another); the "
            "optimizer") in note, note
    (tmp_path / "config.json").write_text(json.dumps({**said, "scale_attn_weights": False}))  # alone, it is named
    note = load_weights(model, tmp_path, m)
    assert ("transposed; its config.json's scale_attn_weights=false, which this GPT does not have (true here): the "
            "function they compute here is another); the optimizer") in note, note
    (tmp_path / "config.json").write_text(json.dumps({**said, "layer_norm_epsilon": 1e-6, "scale_attn_weights": False,
                                                      "scale_attn_by_inverse_layer_idx": True}))
    note = load_weights(model, tmp_path, m)
    assert ("its config.json's layer_norm_epsilon=1e-06, scale_attn_weights=false and scale_attn_by_inverse_layer_idx"
            "=true, which this GPT does not have (1e-05, true and false here): the function") in note, note


def test_a_broken_index_or_shard_is_refused_in_one_line_naming_the_file_to_download(tmp_path):
    """An index cut short, or not a map of tensor names to files; a shard torn, holding no tensors by
    name, or missing (the first three of them named); a shard alone, its index gone: each is one line
    naming the file, where loading the part there is would leave the rest of the model at its init."""
    sd = _nanogpt_state(seed=5)
    weight_map = _shard(_hf_state(sd), tmp_path, "model.safetensors", parts=4)
    files = sorted(set(weight_map.values()))
    index = tmp_path / "model.safetensors.index.json"
    whole = index.read_text()
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")

    def refused(source=tmp_path) -> str:
        with pytest.raises(ConfigError) as e:
            load_weights(model, source, m)
        return str(e.value)

    index.write_text(whole[:100])  # a download cut short
    assert refused() == (f"init_weights={index}: not a readable index of weight files (JSONDecodeError); "
                         "download it again")
    for bad in ({"weight_map": sorted(files)}, {"weight_map": {"transformer.wte.weight": 3}}, ["weight_map"]):
        index.write_text(json.dumps(bad))
        assert refused() == f"init_weights={index}: not an index of weight files (no weight_map); download it again"
    index.write_text(whole)
    torn = (tmp_path / files[1]).read_bytes()
    (tmp_path / files[1]).write_bytes(torn[:len(torn) // 2])
    assert refused(tmp_path / files[0]) == (
        f"init_weights={tmp_path / files[1]}: not a readable checkpoint or state dict (SafetensorError); download it "
        "again (one of the files model.safetensors.index.json names)")
    (tmp_path / files[1]).write_bytes(torn)
    for f in files:
        (tmp_path / f).unlink()
    assert refused() == (f"init_weights={index}: 4 of the 4 files its weight_map names are not in {tmp_path} "
                         f"({files[0]}, {files[1]}, {files[2]}); download the whole folder")


def test_a_shard_alone_or_holding_no_tensors_by_name_is_refused(tmp_path):
    """pytorch_model-0000N-of-0000M.bin passed without its index, or one that torch.load reads as a
    list: one line each, where the first would load the quarter of the model it holds; a shard of
    one is the whole model."""
    weight_map = _shard(_hf_state(_nanogpt_state(seed=6)), tmp_path, "pytorch_model.bin", parts=4)
    files = sorted(set(weight_map.values()))
    model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
    torch.save(list(torch.load(tmp_path / files[2]).values()), tmp_path / files[2])
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / files[0], m)
    assert str(e.value) == f"init_weights={tmp_path / files[2]}: holds no tensors by name; download the shard again"
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    with pytest.raises(ConfigError) as e:
        load_weights(model, tmp_path / files[0], m)
    assert str(e.value) == (f"init_weights={tmp_path / files[0]}: one of 4 shards, without the "
                            "pytorch_model.bin.index.json that names the others; download the whole folder")
    (tmp_path / "one").mkdir()  # one shard of one: the whole model, read without an index
    torch.save(_hf_state(_nanogpt_state(seed=6)), tmp_path / "one" / "pytorch_model-00001-of-00001.bin")
    assert "29 of the model's 29 " \
        f"tensors from {tmp_path / 'one' / 'pytorch_model-00001-of-00001.bin'} (Hugging Face GPT-2's" \
        in load_weights(model, tmp_path / "one" / "pytorch_model-00001-of-00001.bin", m)


def test_a_whole_file_beside_the_index_an_earlier_sharded_save_left_is_read_itself(tmp_path):
    """transformers' save_pretrained of a whole model.safetensors over a sharded save removes the
    shards and leaves their index: the folder, and the file named, read the whole file."""
    from safetensors.torch import save_file

    sd = _nanogpt_state(seed=7)
    _shard(_hf_state(_nanogpt_state(seed=8)), tmp_path, "model.safetensors")
    for f in tmp_path.glob("model-*-of-*.safetensors"):
        f.unlink()
    save_file(_hf_state(sd), str(tmp_path / "model.safetensors"))
    for source in (tmp_path, tmp_path / "model.safetensors"):
        model, m = _gpt(f"model.block_size={T}", "model.act=gelu_tanh")
        assert "29 of the model's 29 " \
            f"tensors from {tmp_path / 'model.safetensors'} (Hugging" in load_weights(model, source, m)
        with torch.no_grad():
            torch.testing.assert_close(model(_idx()), _reference_logits(sd, _idx(), "tanh"), rtol=1e-4, atol=1e-4)
