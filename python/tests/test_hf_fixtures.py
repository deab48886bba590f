"""The committed Hugging Face fixtures (tests/fixtures/hf) are whole and consistent: numpy and safetensors only.

Guards against a half-regenerated set: every fixture has its reference, the
stored loss is the cross-entropy of the stored logits, every stored parameter
has a gradient of its shape (and nothing else has one), and config.json names
the expected class. The C++ tests compare zinc against these references.
"""
import json

import numpy as np
import pytest

from conftest import REPO

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")

FIXTURES = REPO / "tests" / "fixtures" / "hf"
# name -> (architecture, tied embedding, dtype of the stored weights, sharded)
EXPECTED = {
    "gpt2": ("GPT2LMHeadModel", True, "F32", True),
    "llama_gqa": ("LlamaForCausalLM", False, "F32", False),
    "qwen2_tied": ("Qwen2ForCausalLM", True, "BF16", False),
    "llama_bias_hd": ("LlamaForCausalLM", True, "F32", False),
    "mistral": ("MistralForCausalLM", False, "F32", False),
    "qwen3": ("Qwen3ForCausalLM", False, "F32", False),
    "gemma": ("GemmaForCausalLM", True, "F32", False),
    "gemma2": ("Gemma2ForCausalLM", True, "F32", False),
    "gemma3": ("Gemma3ForCausalLM", True, "F32", False),
    "phi3": ("Phi3ForCausalLM", False, "F32", False),
    "olmo2": ("Olmo2ForCausalLM", False, "F32", False),
    "granite": ("GraniteForCausalLM", True, "F32", False),
    "gpt_neox": ("GPTNeoXForCausalLM", False, "F32", False),
    "gpt_neox_seq": ("GPTNeoXForCausalLM", False, "F32", False),
    "smollm3": ("SmolLM3ForCausalLM", True, "F32", False),
    "mixtral": ("MixtralForCausalLM", False, "F32", False),
    "qwen3_moe": ("Qwen3MoeForCausalLM", False, "F32", False),
    "mistral_window": ("MistralForCausalLM", False, "F32", False),
    "llama_yarn": ("LlamaForCausalLM", False, "F32", False),
    "qwen3_moe_window": ("Qwen3MoeForCausalLM", False, "F32", False),
    "phi3_orig_top": ("Phi3ForCausalLM", False, "F32", False),
}
# The untied output head's name in the checkpoint, where it is not lm_head.weight.
HEAD = {"GPTNeoXForCausalLM": "embed_out.weight"}
B, T, V = 2, 12, 96


def header(path):
    """A safetensors file's header: name -> {dtype, shape, data_offsets} (bf16 needs no numpy type this way)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def weight_files(folder):
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    return ["model.safetensors"], None


def test_every_fixture_is_there():
    found = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "config.json").exists())
    assert found == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture(name):
    arch, tied, dtype, sharded = EXPECTED[name]
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert config["vocab_size"] == V
    assert bool(config.get("tie_word_embeddings", True)) == tied
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == 64

    # The weights, through the index where sharded.
    files, weight_map = weight_files(folder)
    assert (weight_map is not None) == sharded
    if sharded:
        assert len(files) >= 2
    params = {}
    for f in files:
        h = header(folder / f)
        for k, v in h.items():
            assert k not in params, "%s in two files" % k
            assert v["dtype"] == dtype, (k, v["dtype"])
            params[k] = tuple(v["shape"])
            if weight_map is not None:
                assert weight_map[k] == f, k
    if weight_map is not None:
        assert set(weight_map) == set(params)
    assert (HEAD.get(arch, "lm_head.weight") in params) == (not tied)  # a tied head is the embedding, not stored

    ref = safetensors_numpy.load_file(str(folder / "reference.safetensors"))
    ids, targets, logits, loss = ref["input_ids"], ref["targets"], ref["logits"], ref["loss"]
    assert ids.dtype == np.int32 and ids.shape == (B, T)
    assert targets.dtype == np.int32 and targets.shape == (B, T)
    assert np.array_equal(ids[:, 1:], targets[:, :-1])  # one token stream, shifted
    assert ids.min() >= 0 and max(ids.max(), targets.max()) < V
    assert logits.dtype == np.float32 and logits.shape == (B, T, V)
    assert loss.dtype == np.float32 and loss.shape == (1,)

    # loss = mean cross-entropy over the B*T positions, recomputed from the stored logits; for an MoE model
    # with output_router_logits, plus router_aux_loss_coef times the stored load-balancing loss.
    z = logits.reshape(-1, V).astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    ce = -logp[np.arange(B * T), targets.reshape(-1)].mean()
    moe = bool(config.get("output_router_logits", False))
    extra = set()
    if moe:
        aux = ref["aux_loss"]
        assert aux.dtype == np.float32 and aux.shape == (1,)
        # E * sum_e f_e P_e with sum_e f_e = top_k: at least top_k (perfect balance), at most E * top_k.
        k = config["num_experts_per_tok"]
        assert k - 1e-5 <= aux[0] <= config["num_local_experts"] * k
        ce = ce + config["router_aux_loss_coef"] * float(aux[0])
        extra.add("aux_loss")
    np.testing.assert_allclose(loss[0], ce, rtol=1e-5)

    grads = {k[len("grad."):]: v for k, v in ref.items() if k.startswith("grad.")}
    assert set(grads) == set(params)
    for k, shape in params.items():
        g = grads[k]
        assert g.dtype == np.float32 and g.shape == shape, (k, g.shape, shape)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, k  # every parameter takes part
    assert set(ref) == {"input_ids", "targets", "logits", "loss"} | extra | {"grad." + k for k in grads}
