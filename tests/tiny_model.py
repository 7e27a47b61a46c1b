"""A tiny random Llama-family checkpoint in HF format (Llama, Mistral, Qwen2, Qwen3, Gemma 3),
and an independent dense reference in float64 that follows transformers' modeling code."""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(61)]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


GEMMA3 = "Gemma3ForCausalLM"
QK_NORM_ARCHS = ("Qwen3ForCausalLM", GEMMA3)


def write_tiny_checkpoint(path, *, arch="LlamaForCausalLM", dtype="float32", heads=4, kv_heads=2,
                          hidden=32, layers=2, bias=False, tie=None, rope_scaling=None, shards=1,
                          seed=0, head_dim=None, sliding_window=None, layer_types=None,
                          extra_config=None) -> dict[str, np.ndarray]:
    """Writes config/safetensors/tokenizer files; returns the float32 weights as stored.
    Gemma 3 ties its embeddings by default and stores its norms as w of x * (1 + w)."""
    rng = np.random.default_rng(seed)
    tie = arch == GEMMA3 if tie is None else tie
    head_dim = head_dim or hidden // heads
    inter = hidden * 2
    vocab = len(VOCAB)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        if arch in QK_NORM_ARCHS:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
        if arch == GEMMA3:
            shapes.update({p + "pre_feedforward_layernorm.weight": (hidden,),
                           p + "post_feedforward_layernorm.weight": (hidden,)})
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
        if bias:
            shapes.update({p + f"self_attn.{n}_proj.bias": (shapes[p + f"self_attn.{n}_proj.weight"][0],)
                           for n in "qkv"})
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            w = (0.0 if arch == GEMMA3 else 1.0) + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) * (0.5 if name.endswith("bias") else 1.0 / np.sqrt(shape[-1]))
        stored_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        weights[name] = w.astype(np.float32).astype(stored_dtype)
    os.makedirs(path, exist_ok=True)
    _save_shards(path, weights, shards)
    config = {
        "architectures": [arch], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": tie, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": dtype, "head_dim": head_dim,
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if sliding_window:
        config["sliding_window"] = sliding_window
    if layer_types:
        config["layer_types"] = layer_types
    if arch == GEMMA3:
        config.update({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
                       "rope_local_base_freq": 10.0, "rms_norm_eps": 1e-6})
    config.update(extra_config or {})
    if arch == "LlamaForCausalLM":
        config["attention_bias"] = bias
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    _save_tokenizer(path)
    return {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}


def _save_shards(path, weights, shards):
    names = list(weights)
    if shards == 1:
        save_file(weights, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _save_tokenizer(path):
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
                   "chat_template": TEMPLATE}, f)


def assert_greedy_matches_reference(llm, weights, config, tolerance=2e-4, max_tokens=12):
    """Greedy tokens of an 11-token prompt equal the reference's argmax at every step, and the
    top-5 logprobs are within `tolerance` of the reference's."""
    from ember_cupy import SamplingParams
    prompt = [3 + (7 * i) % 60 for i in range(11)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], params)[0].outputs[0]
    ref = reference_logits(weights, config, prompt + out.token_ids)
    for step, entry in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + step]
        ref_logprobs = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert entry.token_id == int(np.argmax(row)), step
        for token, logprob in entry.top:
            assert abs(logprob - ref_logprobs[token]) < tolerance, (step, token, logprob, ref_logprobs[token])


# --- an independent dense reference: plain loops, HF conventions -------------------------
def reference_logits(weights, config, token_ids) -> np.ndarray:
    """Logits [len(token_ids), vocab] of a full causal forward, in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    gemma = config["architectures"][0] == GEMMA3
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    eps = config["rms_norm_eps"]
    norm = (lambda x, weight: _rms(x, 1.0 + weight, eps)) if gemma else (lambda x, weight: _rms(x, weight, eps))
    n = len(token_ids)
    x = w["model.embed_tokens.weight"][token_ids] * (np.sqrt(hidden) if gemma else 1.0)
    scale = config["query_pre_attn_scalar"] ** -0.5 if gemma else head_dim ** -0.5
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        window = _layer_window(config, i)
        theta = config["rope_local_base_freq"] if gemma and window else config["rope_theta"]
        inv_freq = _inv_freq(head_dim, theta, None if gemma and window else config.get("rope_scaling"))
        angles = np.arange(n)[:, None] * inv_freq[None, :]
        cos = np.concatenate([np.cos(angles)] * 2, axis=-1)
        sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
        h = norm(x, w[p + "input_layernorm.weight"])
        proj = lambda name: h @ w[p + f"self_attn.{name}_proj.weight"].T + w.get(p + f"self_attn.{name}_proj.bias", 0)  # noqa: E731
        q = proj("q").reshape(n, heads, head_dim)
        k = proj("k").reshape(n, kv_heads, head_dim)
        v = proj("v").reshape(n, kv_heads, head_dim)
        if p + "self_attn.q_norm.weight" in w:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        query_pos, key_pos = np.arange(n)[:, None], np.arange(n)[None, :]
        masked = (key_pos > query_pos) | ((query_pos - key_pos >= window) if window else False)
        attn = np.zeros((n, heads, head_dim))
        for hd in range(heads):
            kv = hd // (heads // kv_heads)
            scores = q[:, hd] @ k[:, kv].T * scale
            scores[masked] = -np.inf
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn[:, hd] = probs @ v[:, kv]
        out = attn.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            x = x + norm(out, w[p + "post_attention_layernorm.weight"])
            h = norm(x, w[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + out
            h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        act = _gelu_tanh(gate) if gemma else gate / (1 + np.exp(-gate))
        out = (act * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = x + (norm(out, w[p + "post_feedforward_layernorm.weight"]) if gemma else out)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(x, w["model.norm.weight"]) @ head.T


def _layer_window(config, index) -> int:
    """The sliding window of layer `index` as transformers applies it (0 = none)."""
    window = config.get("sliding_window") or 0
    if "layer_types" in config:
        return window if config["layer_types"][index] == "sliding_attention" else 0
    arch = config["architectures"][0]
    if arch == "MistralForCausalLM":
        return window
    if arch == GEMMA3:
        return window if (index + 1) % config.get("sliding_window_pattern", 6) else 0
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and config.get("use_sliding_window"):
        return window if index >= config["max_window_layers"] else 0
    return 0


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _rms(x, weight, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _inv_freq(head_dim, theta, scaling):
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    if scaling and scaling["rope_type"] == "linear":
        inv = inv / scaling["factor"]
    elif scaling and scaling["rope_type"] == "llama3":
        lo, hi, old = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
        out = []
        for f in inv:
            wavelen = 2 * np.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / scaling["factor"])
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / scaling["factor"] + smooth * f)
        inv = np.array(out)
    return inv
