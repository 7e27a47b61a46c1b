"""llguidance's parser limits for every constraint, and the refusal of a grammar too large.

Measured on llguidance 1.9.1 (SmolLM2's 49k vocabulary, one core of a shared 2-vCPU host): a
Lark chain `r{i}: "t{i}" | r{i+1}` of n rules is 2n grammar symbols, and both its build and its
first mask grow faster than n, because the first parser row predicts every rule and llguidance
checks no limit on that row: n = 10,000 (20k symbols) builds in 1.4 s + 0.7 s first mask, 16,000
in 2.3 + 2.6 s, 20,000 in 3.2 + 4.3 s, 30,000 in 5.6-9.6 + 8 s. Ordinary schemas are far
cheaper per symbol: a 225 KB schema of 200 tools with 20 arguments each is 19.4k symbols and
builds in 0.4 s, first mask included. MAX_GRAMMAR_SYMBOLS (32,768) admits that schema with room
and bounds the worst build seen to a few seconds; the refusal comes once the grammar is parsed,
before it is built (the 60k-symbol chain of 30,000 rules: 3-4 s, against 14-18 s to build it and
compute its first mask). Every later mask step is bounded by llguidance's
defaults, set explicitly here: at most 2,000 items in a row (the next row of the chain above has
30,001: the request ends with finish_reason "error"), 50,000 items and 200,000 lexer fuel per
step (~2.5 ms and ~15 ms by llguidance's figures; the slowest later step measured was 22 ms).
initial_lexer_fuel stays at its default: lowered to 10,000, a 10,000-rule chain did not finish
building in 120 s. verbose_errors is off: llguidance would otherwise copy the whole grammar and
parser state into every error, which messages.brief cuts away anyway.
"""
from __future__ import annotations

import llguidance

MAX_GRAMMAR_SYMBOLS = 32768
MAX_ITEMS_IN_ROW = 2000
STEP_MAX_ITEMS = 50_000
STEP_LEXER_FUEL = 200_000

PARSER_LIMITS = llguidance.LLParserLimits(
    max_grammar_size=MAX_GRAMMAR_SYMBOLS, max_items_in_row=MAX_ITEMS_IN_ROW, step_max_items=STEP_MAX_ITEMS,
    step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)
_TOO_MANY_SYMBOLS = "grammar size (number of symbols) too big"   # llguidance's error text


def grammar_size_refusal(kind: str, error: str) -> str | None:
    """The client's message for a build refused for its size, or None for another error."""
    if _TOO_MANY_SYMBOLS not in error:
        return None
    return (f"structured_outputs.{kind} compiles to more than {MAX_GRAMMAR_SYMBOLS} grammar symbols; "
            f"the limit is {MAX_GRAMMAR_SYMBOLS} symbols per constraint")
