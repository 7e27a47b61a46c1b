"""DeltaAccumulator: delta outputs merged (a slow stream reader's backlog, a non-streaming answer)."""
from ember_cupy.engine.sampler import TokenLogprobs
from ember_cupy.outputs import CompletionOutput, DeltaAccumulator, RequestOutput


def _delta(texts_ids, finished=False, prompt_logprobs=None, with_logprobs=True):
    outputs = []
    for index, (text, ids) in enumerate(texts_ids):
        lps = [TokenLogprobs(t, -float(t), []) for t in ids] if with_logprobs else None
        outputs.append(CompletionOutput(index, text, ids, text, ids, "length" if finished else None,
                                        logprobs=lps, cumulative_logprob=-1.0))
    return RequestOutput("r", "p", [1, 2], outputs, finished, prompt_logprobs=prompt_logprobs)


def test_deltas_merge_in_order_per_sequence():
    acc = DeltaAccumulator()
    assert not acc and acc.take() is None
    acc.add(_delta([("Hel", [5]), ("A", [7])], prompt_logprobs=[None, "lp"]))
    acc.add(_delta([("lo", [6, 8]), ("", [])]))
    acc.add(_delta([("!", [9]), ("B", [10])], finished=True))
    assert (acc.num_chars, acc.num_token_ids) == (8, 6)
    merged = acc.take()
    assert merged.finished and merged.prompt_logprobs == [None, "lp"]
    first, second = merged.outputs
    assert (first.text, first.token_ids, first.delta_text) == ("Hello!", [5, 6, 8, 9], "Hello!")
    assert [lp.token_id for lp in first.logprobs] == [5, 6, 8, 9]
    assert (second.text, second.token_ids, second.finish_reason) == ("AB", [7, 10], "length")
    assert not acc and (acc.num_chars, acc.num_token_ids) == (0, 0)


def test_prompt_logprobs_and_missing_logprobs_stay_as_sent():
    acc = DeltaAccumulator()
    acc.add(_delta([("a", [1])], with_logprobs=False))
    merged = acc.take()
    assert merged.outputs[0].logprobs is None and merged.prompt_logprobs is None
    acc.add(_delta([("b", [2])], prompt_logprobs=None))
    assert acc.take().prompt_logprobs is None   # a later output does not repeat them
