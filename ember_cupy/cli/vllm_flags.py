"""vLLM's `serve` flags that ember-cupy's own do not already cover: honoured (--seed, --chat-template,
--generation-config, --override-generation-config, --max-logprobs), accepted with no effect where
they mean nothing on one machine without PyTorch (each says why in --help), or refused with the
reason (--tensor-parallel-size / --pipeline-parallel-size above 1, a --load-format or --tokenizer
this engine cannot read). So a vLLM command line pastes."""
from __future__ import annotations

import argparse
import json

from ember_cupy.chat_template import read_chat_template
from ember_cupy.generation_config import sampling_defaults
from ember_cupy.sampling_params import MAX_LOGPROBS, SamplingParams
from ember_cupy.vllm_compat import NO_EFFECT, PARALLEL_SIZES, check_parallel_size

LOAD_FORMATS = ("auto", "gguf", "safetensors")


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def vllm_flags(parser, add) -> None:
    g = parser.add_argument_group("vLLM compatibility (honoured)")
    add(g, "--seed", type=int, default=None,
        help="requests without a seed draw from seeds derived from this one in arrival order: the same "
             "requests in the same order give the same tokens after a restart")
    add(g, "--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) "
                                                 "used instead of the model's")
    add(g, "--generation-config", default="auto",
        help="the requests' default sampling parameters: auto = a Hugging Face directory's "
             "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens; "
             "a GGUF file has none), vllm = none, or a directory holding a generation_config.json")
    add(g, "--override-generation-config", type=json_object, default=None,
        help='JSON over the generation config, e.g. \'{"temperature": 0.5}\'')
    add(g, "--max-logprobs", type=int, default=MAX_LOGPROBS,
        help=f"most logprobs / top_logprobs / prompt_logprobs a request may ask (at most {MAX_LOGPROBS})")
    add(g, "--tensor-parallel-size", "-tp", type=int, default=1, help="1 only: a model runs on one device")
    add(g, "--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only: a model runs on one device")
    add(g, "--load-format", choices=LOAD_FORMATS, default="auto", help="the file's own format is read")
    add(g, "--tokenizer", default=None, help="only the model itself: its tokenizer is the one in the file")
    ignored = parser.add_argument_group("vLLM compatibility (accepted, no effect)")
    for name, (kind, why) in NO_EFFECT.items():
        flag = "--" + name.replace("_", "-")
        if kind is None:
            ignored.add_argument(flag, action="store_true", help=why)
        else:
            ignored.add_argument(flag, type=kind, metavar="X", help=why)


def check_vllm_flags(args) -> None:
    """The refusals, each as one line saying why."""
    for name in PARALLEL_SIZES:
        check_parallel_size(name, getattr(args, name), "--" + name.replace("_", "-"))
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in 0..{MAX_LOGPROBS}, got {args.max_logprobs}")
    if args.tokenizer is not None and args.tokenizer not in (args.model, args.model_tag):
        raise ValueError(f"--tokenizer {args.tokenizer!r}: only the model's own tokenizer can be used")
    if args.chat_template is not None:
        read_chat_template(args.chat_template)


def check_generation_config(args, model_path: str) -> None:
    """A generation config that is missing or holds a bad value fails before the model loads."""
    SamplingParams(**sampling_defaults(model_path, args.generation_config, args.override_generation_config))
