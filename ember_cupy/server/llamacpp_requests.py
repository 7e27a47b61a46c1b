"""llama-server's /completion request mapped onto the /v1/completions body of its prompt's token ids,
which then validates and samples exactly as /v1/completions does.

The prompt's text pieces are tokenized as llama-server does: BOS (where the model adds one) only
before a prompt that starts with text. `samplers` switches off the samplers it leaves out (its order
is not followed: penalties, top_k, top_p, min_p, temperature always). repeat_penalty is vLLM's
repetition penalty over the prompt and the output (repeat_last_n 0: no penalties); logit_bias
given as text biases each of the text's tokens, and false is -100 (OpenAI's floor: never picked in
practice). grammar -> structured_outputs.grammar (GBNF, which llguidance reads), json_schema ->
structured_outputs.json.
"""
from __future__ import annotations

from ember_cupy.server.protocol.llamacpp import RANDOM_SEEDS, SAMPLER_NAMES, LlamaCppCompletionRequest

NEVER = -100.0   # the bias of a token given `false`
# llama-server's request field -> the SamplingParams field of the server's defaults (--temp... or
# --override-generation-config) that stands in for it when a request leaves it out
SERVER_DEFAULTS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "n_predict": "max_tokens"}


def with_server_defaults(req: LlamaCppCompletionRequest, defaults: dict) -> LlamaCppCompletionRequest:
    """req with the server's defaults in the sampling fields it left out (llama-server's --temp,
    --top-k... set its requests' defaults); the others keep llama-server's."""
    unset = {name: defaults[field] for name, field in SERVER_DEFAULTS.items()
             if name not in req.model_fields_set and defaults.get(field) is not None}
    return req.model_copy(update=unset) if unset else req


def completion_body(req: LlamaCppCompletionRequest, token_ids: list[int], max_model_len: int,
                    logit_bias: dict[str, float]) -> dict:
    """The /v1/completions body asking for what `req` asks for its prompt `token_ids`."""
    use = set(SAMPLER_NAMES if req.samplers is None else req.samplers)
    room = max(max_model_len - len(token_ids), 1)   # llama-server stops where the context is full
    body: dict = {"prompt": token_ids, "stop": req.stop, "ignore_eos": req.ignore_eos,
                  "max_tokens": min(req.n_predict, room) if req.n_predict > 0 else room, **_sampling(req, use)}
    penalties = "penalties" in use and req.repeat_last_n != 0
    body.update(repetition_penalty=req.repeat_penalty if penalties else 1.0,
                presence_penalty=req.presence_penalty if penalties else 0.0,
                frequency_penalty=req.frequency_penalty if penalties else 0.0)
    if req.seed not in RANDOM_SEEDS:
        body["seed"] = req.seed
    if logit_bias:
        body["logit_bias"] = logit_bias
    if req.n_probs:
        body["logprobs"] = req.n_probs
    if req.grammar is not None:
        body["structured_outputs"] = {"grammar": req.grammar}
    elif req.json_schema is not None:
        body["structured_outputs"] = {"json": req.json_schema}
    return body


def _sampling(req: LlamaCppCompletionRequest, use: set[str]) -> dict:
    """Every sampling field, so that none takes the model's generation_config default (llama-server
    reads none)."""
    if req.temperature <= 0:   # llama-server's greedy
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    top_k = req.top_k if "top_k" in use and req.top_k > 0 else 0
    top_p = req.top_p if "top_p" in use else 1.0
    if top_p == 0:   # llama-server keeps at least one token: the likeliest
        top_k, top_p = 1, 1.0
    return {"temperature": req.temperature if "temperature" in use else 1.0, "top_k": top_k, "top_p": top_p,
            "min_p": req.min_p if "min_p" in use else 0.0}


def logit_bias(pairs: list[tuple[int | str, float | None]], text_ids: dict[str, list[int]]) -> dict[str, float]:
    """OpenAI's {"token id": bias} for llama-server's pairs (`text_ids`: each text key's token ids)."""
    out: dict[str, float] = {}
    for key, bias in pairs:
        for token_id in text_ids[key] if isinstance(key, str) else [key]:
            out[str(token_id)] = NEVER if bias is None else max(min(bias, 100.0), NEVER)
    return out


def generation_settings(req: LlamaCppCompletionRequest, body: dict, n_ctx: int, model: str) -> dict:
    """The settings a result reports, under llama-server's names (as its results do: the values
    asked for; `samplers` the ones that run, in the order they run)."""
    use = SAMPLER_NAMES if req.samplers is None else req.samplers
    return {"n_ctx": n_ctx, "n_predict": req.n_predict, "max_tokens": body["max_tokens"] if req.n_predict else 0,
            "model": model,
            "seed": req.seed if req.seed not in RANDOM_SEEDS else 0xFFFFFFFF, "temperature": req.temperature,
            "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p, "repeat_penalty": req.repeat_penalty,
            "repeat_last_n": req.repeat_last_n, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "stop": req.stop, "ignore_eos": req.ignore_eos,
            "stream": req.stream, "n_probs": req.n_probs, "grammar": req.grammar or "", "json_schema": req.json_schema,
            "logit_bias": [[int(k), v] for k, v in body.get("logit_bias", {}).items()],
            "samplers": [name for name in ("penalties", "top_k", "top_p", "min_p", "temperature") if name in use],
            "mirostat": 0, "typical_p": 1.0, "dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "timings_per_token": req.timings_per_token, "post_sampling_probs": False, "lora": []}
