"""The standalone Python API: `LLM(model).generate(...)` and `LLM.chat(...)`."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence as Seq

import numpy as np

from ember_cupy import tool_calls
from ember_cupy.config import EngineConfig
from ember_cupy.engine.llm_engine import LLMEngine
from ember_cupy.engine.pooling import PoolingParams
from ember_cupy.outputs import EmbeddingRequestOutput, OutputKind, RequestOutput
from ember_cupy.sampling_params import SamplingParams
from ember_cupy.vllm_compat import NO_EFFECT, PARALLEL_SIZES, check_parallel_size


class LLM:
    """Offline batched inference. `LLM()` loads the default model (SmolLM2-135M-Instruct).

    Its steps take the whole token budget unless max_num_prefill_tokens is given: every request
    of a generate() call is there from the start, so no later one waits for a long step (the
    server's short CPU steps, EngineConfig.max_num_prefill_tokens, cost a batch of prompts ~35%)."""

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **config_fields):
        """config_fields: EngineConfig's fields; vLLM's engine arguments are taken too, with no
        effect where they mean nothing here (ember_cupy/vllm_compat.py: enforce_eager,
        trust_remote_code, ...); tensor/pipeline_parallel_size must be 1, tokenizer the model."""
        config_fields = _without_vllm_arguments(model, config_fields)
        if config is not None and config_fields:
            raise ValueError("pass either config or individual EngineConfig fields, not both")
        if config is None:
            config = EngineConfig(**config_fields)
            if "max_num_prefill_tokens" not in config_fields:
                config = dataclasses.replace(config, max_num_prefill_tokens=config.max_num_batched_tokens)
        self.engine = LLMEngine(model, config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's LLM.get_tokenizer): encode, decode, apply_chat_template."""
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, lora_request=None, priority: Seq[int] | None = None,
                 add_special_tokens: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion, batched continuously; outputs in prompt order. The
        signature is vLLM's LLM.generate, so its scripts run as they are.

        prompts: a string, a list of token ids, or a list of either; each may also be given as
        vLLM's {"prompt": text} or {"prompt_token_ids": ids}.
        sampling_params: one for every prompt, or one per prompt (default: the model's).
        use_tqdm: taken for vLLM's callers; ember-cupy draws no progress bar.
        lora_request: LoRA adapters are not supported: anything but None is a ValueError.
        priority: one per prompt, under the priority scheduling policy (lower runs first).
        add_special_tokens: whether string prompts get the model's BOS; False for prompts already
        rendered by a chat template (chat() passes it).
        """
        _refuse_lora(lora_request)
        prompts = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if priority and any(priority) and self.engine.config.policy != "priority":   # as vLLM and the server
            raise ValueError(f"priority needs the priority scheduling policy (policy='priority'); "
                             f"this LLM runs with '{self.engine.config.policy}'")
        request_ids = []
        try:
            for index, (prompt, sampling) in enumerate(zip(prompts, params_list)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, sampling, priority=priority[index] if priority else 0,
                                        output_kind=OutputKind.FINAL_ONLY, add_special_tokens=add_special_tokens)
                request_ids.append(request_id)
            return self._run(request_ids)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them;
        sampling_params: one for all, or one per conversation. The other arguments are vLLM's
        LLM.chat's of the same names (use_tqdm and lora_request as for generate()).

        tools / tool_choice / parallel_tool_calls: OpenAI's (ember_cupy/tool_calls.py); a
        completion that called functions has finish_reason "tool_calls" and its `tool_calls`
        (ToolCall: id, name, arguments as JSON text)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (one "
                             "conversation) or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        _refuse_lora(lora_request)
        spec = tool_calls.parse_tools(tools, tool_choice, parallel_tool_calls)
        supports = tool_calls.template_supports_tools(self.tokenizer)
        params = [tool_calls.constrain(p, spec, supports)
                  for p in self._as_params_list(sampling_params, len(conversations))]
        prompts = [tool_calls.render_chat(self.tokenizer, c, spec, add_generation_prompt,
                                          **(chat_template_kwargs or {})) for c in conversations]
        outputs = self.generate(prompts, params, add_special_tokens=False)
        if spec.active:
            for output in outputs:
                for completion in output.outputs:
                    _, calls = tool_calls.parse_output(completion.text, spec, supports)
                    if calls:
                        completion.tool_calls = calls
                        completion.finish_reason = "tool_calls"
        return outputs

    def embed(self, prompts, pooling_params: PoolingParams | None = None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, lora_request=None) -> list[EmbeddingRequestOutput]:
        """Embeddings (`.outputs.embedding` as vLLM's, also `.embedding`: the L2-normalised final
        hidden state of each prompt's last token, ember_cupy/engine/pooling.py), in prompt order,
        batched continuously through the same scheduler as generate(). prompts, use_tqdm,
        lora_request: as for generate(); truncate_prompt_tokens: PoolingParams' (an input's last k tokens, -1: what the context holds)."""
        _refuse_lora(lora_request)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        pooling_params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            pooling_params = dataclasses.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        request_ids = []
        try:
            for prompt in self._as_prompt_list(prompts):
                request_ids.append(f"offline-embed-{next(self._ids)}")
                self.engine.add_request(request_ids[-1], prompt, pooling_params)
            return [EmbeddingRequestOutput.of(output) for output in self._run(request_ids)]
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[r] for r in request_ids]

    @staticmethod
    def _as_prompt_list(prompts) -> list:
        """prompts as a list of strings and token-id lists. Each may also be one of vLLM's prompt
        dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt)."""
        if isinstance(prompts, (str, dict)) or _token_ids(prompts) is not None:
            prompts = [prompts]     # one prompt
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of them")
        return [_one_prompt(prompt, index) for index, prompt in enumerate(prompts)]

    def _as_params_list(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams(**self.engine.sampling_defaults)] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}"
                             + (" (SamplingParams(**that_dict) makes one)" if isinstance(params, dict) else ""))
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return list(params)


def _without_vllm_arguments(model, fields: dict) -> dict:
    """fields less vLLM's arguments that change nothing here; ValueError for those that would."""
    for name in PARALLEL_SIZES:
        check_parallel_size(name, fields.pop(name, 1))
    tokenizer = fields.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise ValueError(f"tokenizer {tokenizer!r}: only the model's own tokenizer can be used")
    return {name: value for name, value in fields.items() if name not in NO_EFFECT}


def _refuse_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported: lora_request must be None")


def _one_prompt(prompt, index: int):
    """A string or a list of token ids, given as such or in a vLLM prompt dict."""
    if isinstance(prompt, dict):
        prompt = _from_prompt_dict(prompt, index)
    if isinstance(prompt, str):
        return prompt
    token_ids = _token_ids(prompt)
    if token_ids is not None:
        return token_ids
    raise ValueError(f"prompts[{index}] must be a string or a non-empty list of token ids (ints), "
                     f"got {type(prompt).__name__}")


def _token_ids(value) -> list[int] | None:
    """value as a list of Python ints when it is a non-empty list or tuple of integers (NumPy's
    too, not bools), else None."""
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    return None


def _from_prompt_dict(prompt: dict, index: int):
    """{"prompt": text} (vLLM's TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt)."""
    if list(prompt) == ["prompt"] and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if list(prompt) == ["prompt_token_ids"] and isinstance(prompt["prompt_token_ids"], (list, tuple)):
        return prompt["prompt_token_ids"]
    raise ValueError(f"prompts[{index}]: a prompt dict holds one key, 'prompt' (a string) or "
                     f"'prompt_token_ids' (a list of token ids); got {sorted(map(str, prompt))}")
