"""Per-request sampling parameters, with OpenAI / vLLM defaults and meanings."""
from __future__ import annotations

from dataclasses import dataclass

from ember_cupy.checks import require
from ember_cupy.structured.params import StructuredOutputsParams


MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16     # stop sequences per request (OpenAI allows 4; vLLM does not bound them)
MAX_STOP_LENGTH = 1024    # characters per stop sequence: a stream holds back up to this - 1
MAX_BAD_WORDS = 64        # bad_words per request, each at most MAX_STOP_LENGTH characters
# Positive logits are divided by the repetition penalty: 1e-300 made them +inf (and NaN after
# arithmetic with other infinities). At 0.01 a logit of 100 (+100 of logit_bias) becomes 2e4,
# and 2e9 after the smallest sampled temperature (1e-5): far from float32's 3e38.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0


def check_truncate_prompt_tokens(value, owner: str) -> None:
    require(value is None or (type(value) is int and (value == -1 or value >= 1)),
            f"{owner}.truncate_prompt_tokens must be -1 (keep all that fits) or an integer >= 1, got {value!r}")


def truncate_prompt(token_ids: list[int], params, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens of `params` (SamplingParams or PoolingParams): the prompt's
    last k tokens (left truncation); -1: as many as leave the context room for params.output_room
    tokens; None: all of them."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return token_ids
    keep = max(1, max_model_len - params.output_room) if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def _as_tuple(value, name: str, item_type) -> tuple:
    if value is None:
        return ()
    if isinstance(value, item_type):
        value = [value]
    require(isinstance(value, (list, tuple)) and all(isinstance(v, item_type) for v in value),
            f"SamplingParams.{name} must be a {item_type.__name__} or a list of them")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 = no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None    # token id -> additive bias
    seed: int | None = None
    max_tokens: int | None = 16       # None = until the context is full
    min_tokens: int = 0
    stop: tuple[str, ...] | str | None = ()
    stop_token_ids: tuple[int, ...] | None = ()
    allowed_token_ids: tuple[int, ...] | None = None   # sample only among these (vLLM's); None: all
    # words never generated (vLLM's): the last token of each word's tokenization (with and without a
    # leading space) is banned wherever the output ends with the tokens before it
    bad_words: tuple[str, ...] | str | None = ()
    # the token sequences of bad_words: filled by the engine's input processor from its tokenizer
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-k logprobs per generated token
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True   # False: token ids only, no text (vLLM's); no stop strings then
    # keep only the prompt's last k tokens (-1: as many as leave room for max_tokens, or one
    # token); None: the whole prompt, refused when too long (vLLM's)
    truncate_prompt_tokens: int | None = None
    # constrained decoding: a JSON schema, any JSON object, a regex, a choice or a grammar (a
    # StructuredOutputsParams or a dict of its fields); vLLM's name
    structured_outputs: StructuredOutputsParams | None = None
    # False: never speculate for this request (the engine's --speculative-config drafts for it
    # otherwise; its output is the same either way, only its speed changes)
    speculative: bool = True

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("stop", _as_tuple(self.stop, "stop", str))
        set_("stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        self._validate_token_restrictions()
        require(all(s for s in self.stop), "SamplingParams.stop must not contain empty strings")
        require(isinstance(self.detokenize, bool),
                f"SamplingParams.detokenize must be True or False, got {self.detokenize!r}")
        require(self.detokenize or not self.stop, "SamplingParams.stop strings need the text: detokenize must be True")
        require(len(self.stop) <= MAX_STOP_STRINGS,
                f"SamplingParams.stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        require(longest <= MAX_STOP_LENGTH,
                f"SamplingParams.stop strings may be at most {MAX_STOP_LENGTH} characters long, got {longest}")
        require(isinstance(self.n, int) and 1 <= self.n <= MAX_N,
                f"SamplingParams.n must be an integer in [1, {MAX_N}], got {self.n!r}")
        require(0.0 <= self.temperature <= 100.0,
                f"SamplingParams.temperature must be in [0, 100], got {self.temperature}")
        require(0.0 < self.top_p <= 1.0, f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        require(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
                f"SamplingParams.top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        require(0.0 <= self.min_p <= 1.0, f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(-2.0 <= value <= 2.0, f"SamplingParams.{name} must be in [-2, 2], got {value}")
        require(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"SamplingParams.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                f"SamplingParams.min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "SamplingParams.min_tokens must be <= max_tokens")
        require(self.seed is None or isinstance(self.seed, int),
                f"SamplingParams.seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                    f"SamplingParams.{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens, "SamplingParams")
        require(isinstance(self.speculative, bool),
                f"SamplingParams.speculative must be True or False, got {self.speculative!r}")
        self._validate_logit_bias()
        if self.structured_outputs is not None:
            set_("structured_outputs", StructuredOutputsParams.from_value(self.structured_outputs))

    def _validate_token_restrictions(self):
        """allowed_token_ids, bad_words and their token ids (vLLM's fields)."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("bad_words", _as_tuple(self.bad_words, "bad_words", str))
        require(len(self.bad_words) <= MAX_BAD_WORDS and all(0 < len(w) <= MAX_STOP_LENGTH for w in self.bad_words),
                f"SamplingParams.bad_words must be at most {MAX_BAD_WORDS} non-empty strings of at most "
                f"{MAX_STOP_LENGTH} characters")
        require(isinstance(self.bad_words_token_ids, tuple) and all(
            isinstance(ids, tuple) and ids and all(type(t) is int for t in ids) for ids in self.bad_words_token_ids),
            "SamplingParams.bad_words_token_ids must be a tuple of non-empty tuples of token ids")
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", _as_tuple(self.allowed_token_ids, "allowed_token_ids", int))
            require(self.allowed_token_ids, "SamplingParams.allowed_token_ids must not be empty (None allows all)")

    def _validate_logit_bias(self):
        if not self.logit_bias:
            return
        bias = {}
        for token, value in self.logit_bias.items():
            try:
                token_id = int(token)
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError("SamplingParams.logit_bias must map token ids to numbers") from None
            require(-100.0 <= value <= 100.0,
                    f"SamplingParams.logit_bias values must be in [-100, 100], got {value}")
            bias[token_id] = value
        object.__setattr__(self, "logit_bias", bias)

    @property
    def output_room(self) -> int:
        """Context tokens the output needs after the prompt (what truncate_prompt_tokens=-1 leaves)."""
        return self.max_tokens or 1

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        ids = (list(self.stop_token_ids) + list((self.logit_bias or {}).keys()) + list(self.allowed_token_ids or ())
               + [token for word in self.bad_words_token_ids for token in word])
        bad = [i for i in ids if not 0 <= i < vocab_size]
        require(not bad, f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab_size})")
