"""What `sparkform contract` asks an engine, and the checks it runs on the answers (the judges
and the table are in sparkform.reports.contract)."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

from sparkform.domain.engine import PROBES, Engine
from sparkform.domain.schema import HostConfig
from sparkform.reports.contract import (
    Ask,
    Contract,
    Finding,
    Request,
    as_int,
    judge_over_input,
    judge_over_window,
    judge_pooled,
    judge_reasoning,
    judge_served_name,
    judge_tokenize,
    judge_version,
    judge_vision,
    judge_window,
    reply_error,
)

# --- the requests --------------------------------------------------------------------------------

# A filler word for prompts of a known length: one token a repeat with most tokenizers.
FILLER = " hello"
TOKENIZE_TEXT_SAMPLE = "What does a client of this engine need to know about its window?"
OVER_BY = 16  # how far past the window prompt + max_tokens goes
GAP = 16  # the prompt stays this many tokens (up to twice this) under the window
REASONING_MAX_TOKENS = 16
CALIBRATION_TRIES = 6


def png_pixel() -> str:
    """A data URL of an 8x8 grey PNG: the smallest image a vision model takes."""
    width = height = 8
    raw = b"".join(b"\x00" + b"\x80\x80\x80" * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _chat(name: str, content: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _count(ask: Ask, name: str, text: str) -> int | None:
    """/tokenize's count of `text` (None: refused, e.g. over the window)."""
    reply = ask(Request("/tokenize", {"model": name, "prompt": text}, front=False))
    body = reply.json() if reply.status == 200 else None
    return as_int(body.get("count")) if isinstance(body, dict) else None


def near_window_prompt(ask: Ask, name: str, window: int) -> tuple[str, int] | None:
    """A prompt of window - 2*GAP .. window - 1 tokens, found with /tokenize (None: not found)."""
    low, high, target = window - 2 * GAP, window - 1, window - GAP
    small, large = _count(ask, name, FILLER * 64), _count(ask, name, FILLER * 128)
    if small is None or large is None or large <= small:
        return None
    per_repeat = (large - small) / 64
    repeats = max(1, round(64 + (target - small) / per_repeat))
    for _ in range(CALIBRATION_TRIES):
        count = _count(ask, name, FILLER * repeats)
        if count is None:  # refused: over the window
            repeats = int(repeats * 0.9)
            continue
        if low <= count <= high:
            return FILLER * repeats, count
        repeats = max(1, repeats + (round((target - count) / per_repeat) or (1 if target > count else -1)))
    return None


def check_pooling_engine(ask: Ask, config: HostConfig, engine: Engine, live_version: str) -> list[Finding]:
    """A pooling engine's contract: its window, each name's answer in its shape (an embedding's
    dimensions, a rerank's scores) and what an input over the window gets."""
    version, _ = judge_version(live_version, config.pin(engine).version)
    findings = [version, judge_window(engine, ask(Request("/v1/models")))]
    route, fields, _ = PROBES[engine.kind]
    for served in engine.names:
        findings.append(judge_pooled(served, engine.kind, ask(Request(route, {"model": served, **fields}))))
    found = near_window_prompt(ask, engine.names[0], engine.max_model_len)
    if found is None:
        window = engine.max_model_len
        findings.append(
            Finding("over window", "fail", f"/tokenize found no prompt of {window - 2 * GAP}..{window - 1} tokens")
        )
    else:
        text, tokens = found
        over = text + FILLER * (3 * GAP)  # at least GAP tokens past the window
        counted = _count(ask, engine.names[0], over)
        # vLLM's /tokenize may itself refuse an input over the window: then it is at least that long.
        tokens = counted if counted is not None else tokens + 3 * GAP
        asked = {"input": over} if engine.kind == "embed" else {"query": "ping", "documents": [over]}
        findings.append(
            judge_over_input(engine.max_model_len, tokens, ask(Request(route, {"model": engine.names[0], **asked})))
        )
    pooling = f"a pooling engine ({engine.kind})"
    findings.append(Finding("tokenize", "skip", f"{pooling} has no chat to hold /tokenize's count against"))
    findings += [Finding(check, "skip", f"{pooling} generates nothing") for check in ("reasoning", "vision")]
    return findings


def check_engine(ask: Ask, config: HostConfig, engine: Engine, live_version: str) -> list[Finding]:
    """Every check of the contract against one engine, in order. NoAnswer passes through."""
    if engine.pooling:
        return check_pooling_engine(ask, config, engine, live_version)
    name = engine.names[0]
    version, row = judge_version(live_version, config.pin(engine).version)
    findings = [version, judge_window(engine, ask(Request("/v1/models")))]
    for served in engine.names:
        findings.append(
            judge_served_name(
                served, ask(Request("/v1/completions", {"model": served, "prompt": "hello", "max_tokens": 1}))
            )
        )
    findings.append(
        judge_tokenize(
            ask(Request("/tokenize", {"model": name, "prompt": TOKENIZE_TEXT_SAMPLE}, front=False)),
            ask(Request("/v1/chat/completions", _chat(name, TOKENIZE_TEXT_SAMPLE, 1))),
        )
    )
    findings.append(_over_window(ask, engine, row))
    if engine.reasoning_parser:
        reply = ask(
            Request(
                "/v1/chat/completions", _chat(name, "Think, then answer: 2 + 2?", REASONING_MAX_TOKENS, ignore_eos=True)
            )
        )
        findings.append(judge_reasoning(REASONING_MAX_TOKENS, reply))
    else:
        findings.append(Finding("reasoning", "skip", "no reasoning_parser: nothing is split off as reasoning"))
    if engine.multimodal:
        alias = engine.names[-1]
        image = [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": png_pixel()}},
        ]
        findings.append(judge_vision(alias, ask(Request("/v1/chat/completions", _chat(alias, image, 4)))))
    else:
        findings.append(Finding("vision", "skip", "multimodal is not set: this engine takes no image"))
    return findings


def _over_window(ask: Ask, engine: Engine, row: Contract | None) -> Finding:
    window = engine.max_model_len
    found = near_window_prompt(ask, engine.names[0], window)
    if found is None:
        return Finding("over window", "fail", f"/tokenize found no prompt of {window - 2 * GAP}..{window - 1} tokens")
    text, tokens = found
    max_tokens = window - tokens + OVER_BY
    reply = ask(
        Request(
            "/v1/completions",
            {"model": engine.names[0], "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        )
    )
    if row is None:
        observed = "error" if reply.status == 400 else "truncation" if reply.status == 200 else reply_error(reply)
        return Finding("over window", "fail", f"observed {observed}; no contract row to hold it against")
    return judge_over_window(row, window, max_tokens, reply)
