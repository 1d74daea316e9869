"""Checking an adapter's `adapter_config.json` (PEFT's LoraConfig) against what vLLM serves.

The refused features are the ones vLLM's own PEFTHelper refuses at load (DoRA, LoRA bias,
modules_to_save, ...) - caught here at registration, with the field named, instead of at the
first request. Raises AdapterInvalid with a fixed `reason` label for metrics.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import regex

from loraplex.adapters_registry.base import AdapterInvalid
from loraplex.adapters_registry.base_model import BaseModelSpec
from loraplex.adapters_registry.json_values import excerpt, is_int, is_number, parse_int

CONFIG_FILE = "adapter_config.json"
# Inits that only set starting weights, so the saved adapter is a plain LoRA (vLLM's list).
_PLAIN_INITS = {"gaussian", "eva", "orthogonal", "mica", "lora_ga"}
# PEFT writes configs of 1-3 KiB; parsing holds the GIL throughout (1 MiB of JSON: 94 ms).
MAX_CONFIG_BYTES = 256 * 1024
# Parentheses a module-name pattern may nest: real ones nest 1-3 deep, and the `regex` package
# compiles recursively (a pattern nested 500 deep raised RecursionError).
MAX_PATTERN_DEPTH = 32
# How many module-name patterns a config may hold (rank_pattern and alpha_pattern keys each), and
# how many characters all of them together with a target_modules regex. PEFT writes a handful of
# short ones (configs of 1-3 KiB); 256 names each linear of a 36-layer model (7 projections a
# layer) explicitly. Compiling holds the GIL, in a registration's worker thread as anywhere:
# 19,490 keys filling the config took 9-11 s of registration (2-core machine), and compiling
# their alternation (`_suffix_patterns`) held the GIL 344 ms in one C call, every stream waiting
# that long; 1,024 keys of 250 characters, 763 ms; one key of a 256 KiB alternation, 616 ms.
# Within both bounds compiling took at most 0.2 s, with no hold above the machine's own
# scheduling noise (~50 ms at a load average of 13).
MAX_PATTERN_KEYS = 256
MAX_PATTERN_CHARS = 8 * 1024
# The matching time one adapter's module-name patterns (target_modules as a string, rank_pattern
# keys) may take, together: microseconds a name, but a catastrophically backtracking pattern took
# 19.6 s on one 31-character module name.
PATTERN_BUDGET_S = 5.0


V = TypeVar("V", int, float)


@dataclass(frozen=True)
class CheckedConfig:
    """What a valid config says about each module: `{"": default, **pattern}` maps."""

    ranks: dict[str, int]  # r and rank_pattern
    alphas: dict[str, float]  # lora_alpha and alpha_pattern
    use_rslora: bool  # scale by alpha / sqrt(r) instead of alpha / r


def invalid(reason: str, message: str, param: str) -> AdapterInvalid:
    return AdapterInvalid(message, param=param, reason=reason)


def _load_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise invalid(
                "size", f"{CONFIG_FILE} is {size} bytes; at most {MAX_CONFIG_BYTES} are read",
                CONFIG_FILE,
            )  # fmt: skip
        config = json.loads(path.read_bytes(), parse_int=parse_int)
    except FileNotFoundError as e:
        raise invalid("missing_config", f"{CONFIG_FILE} is missing", CONFIG_FILE) from e
    except (ValueError, RecursionError) as e:
        # UnicodeDecodeError and JSONDecodeError are ValueErrors; RecursionError: nesting deeper
        # than the parser's stack ("[" x 200,000). The message says where, never what: the
        # bytes may be any file's.
        raise invalid("bad_config", f"{CONFIG_FILE} is not valid JSON: {e}", CONFIG_FILE) from e
    if not isinstance(config, dict):
        raise invalid("bad_config", f"{CONFIG_FILE} is not a JSON object", CONFIG_FILE)
    return config


def _check_features(config: dict[str, Any]) -> None:
    refused = {
        "use_dora": "DoRA (use_dora) is not supported by vLLM",
        "lora_bias": "LoRA bias (lora_bias) is not supported by vLLM",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported by vLLM",
        "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens) is not supported",
        "layer_replication": "layer_replication is not supported by vLLM",
        "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported by vLLM",
        "use_qalora": "QALoRA (use_qalora) is not supported by vLLM",
    }
    for key, why in refused.items():
        if config.get(key):
            raise invalid("unsupported_feature", f"{CONFIG_FILE}: {key}: {why}", key)
    if config.get("bias", "none") != "none":
        raise invalid(
            "unsupported_feature",
            f"{CONFIG_FILE}: bias is {excerpt(config['bias'])}; vLLM supports only 'none'",
            "bias",
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        raise invalid(
            "unsupported_feature",
            f"{CONFIG_FILE}: init_lora_weights {excerpt(init)} modifies the base weights; "
            "convert the adapter to a plain LoRA first",
            "init_lora_weights",
        )


def _check_rank(config: dict[str, Any], max_lora_rank: int) -> dict[str, int]:
    r = config.get("r")
    if not is_int(r) or r < 1:
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: r must be a positive integer, got {excerpt(r)}", "r"
        )
    if r > max_lora_rank:
        raise invalid("rank", f"rank r={r} exceeds max_lora_rank={max_lora_rank}", "r")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: rank_pattern must be an object", "rank_pattern"
        )
    _check_patterns(pattern, "rank_pattern")
    for key, value in pattern.items():
        if not is_int(value) or not 1 <= value <= max_lora_rank:
            raise invalid(
                "rank",
                f"rank_pattern[{excerpt(key)}]={excerpt(value)} must be an integer in "
                f"1..{max_lora_rank} (max_lora_rank)",
                "rank_pattern",
            )
    return {"": r, **pattern}


def _check_alpha(config: dict[str, Any]) -> dict[str, float]:
    """vLLM requires lora_alpha and scales by it (alpha / r): a number, as alpha_pattern's are,
    and finite (JSON's 1e999 reads as infinity)."""
    alpha = config.get("lora_alpha")
    if not is_number(alpha):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: lora_alpha must be a number, got {excerpt(alpha)}",
            "lora_alpha",
        )  # fmt: skip
    if not math.isfinite(alpha):
        raise invalid(
            "bad_config",
            f"{CONFIG_FILE}: lora_alpha must be a finite number, got {excerpt(alpha)}",
            "lora_alpha",
        )  # fmt: skip
    pattern = config.get("alpha_pattern") or {}
    if not isinstance(pattern, dict) or not all(is_number(v) for v in pattern.values()):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: alpha_pattern must map patterns to numbers",
            "alpha_pattern",
        )  # fmt: skip
    if not all(math.isfinite(v) for v in pattern.values()):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: alpha_pattern must map patterns to finite numbers",
            "alpha_pattern",
        )  # fmt: skip
    _check_patterns(pattern, "alpha_pattern")
    return {"": alpha, **pattern}


def _check_pattern_sizes(config: dict[str, Any]) -> None:
    """MAX_PATTERN_KEYS and MAX_PATTERN_CHARS, before any pattern is compiled. The total names
    the field holding most of it."""
    chars: dict[str, int] = {}
    for param in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(param)
        if isinstance(patterns, dict):  # its type is checked with its values
            if len(patterns) > MAX_PATTERN_KEYS:
                raise invalid(
                    "bad_config",
                    f"{CONFIG_FILE}: {param} has {len(patterns)} keys; at most {MAX_PATTERN_KEYS}",
                    param,
                )
            chars[param] = sum(len(key) for key in patterns)  # JSON keys are strings
    if isinstance(targets := config.get("target_modules"), str):
        chars["target_modules"] = len(targets)
    total = sum(chars.values())
    if total > MAX_PATTERN_CHARS:
        raise invalid(
            "bad_config",
            f"{CONFIG_FILE}: the module-name patterns (rank_pattern and alpha_pattern keys, a "
            f"target_modules regex) hold {total} characters; at most {MAX_PATTERN_CHARS}",
            max(chars, key=lambda param: chars[param]),
        )


def _check_patterns(patterns: dict[str, Any], param: str) -> None:
    """Each key is a regex that vLLM (and `rank_for`) match against module names."""
    for key in patterns:
        _compile(key, f"{param} key", param)


def _compile(pattern: object, what: str, param: str) -> regex.Pattern[str]:
    if not isinstance(pattern, str):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: {what} {excerpt(pattern)} is not a string", param
        )
    depth = _nesting(pattern)
    if depth > MAX_PATTERN_DEPTH:
        raise invalid(
            "bad_config",
            f"{CONFIG_FILE}: {what} {excerpt(pattern)} nests groups {depth} deep; at most "
            f"{MAX_PATTERN_DEPTH}",
            param,
        )
    try:
        return regex.compile(pattern)
    except (regex.error, RecursionError) as e:
        raise invalid(
            "bad_config",
            f"{CONFIG_FILE}: {what} {excerpt(pattern)} is not a valid regex: {excerpt(str(e))}",
            param,
        ) from e


def _nesting(pattern: str) -> int:
    """How deep `pattern`'s parentheses nest (escaped ones and those in a set do not count)."""
    depth = deepest = 0
    escaped = in_set = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_set:
            in_set = char != "]"
        elif char == "[":
            in_set = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth -= 1
    return deepest


class PatternClock:
    """Matches an adapter's module-name patterns within PATTERN_BUDGET_S of matching in all,
    with the `regex` package, as vLLM matches them. Its `timeout` stops a runaway match, and
    `concurrent` lets go of the GIL meanwhile: registration validates in a worker thread, but
    `re` holds the GIL for the whole match, which froze every other request. Only the matching
    counts, and each (pattern, name) is matched once: a per-expert MoE adapter holds tens of
    thousands of tensors, two per module."""

    def __init__(self, budget_s: float = PATTERN_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._spent_s = 0.0
        self._known: dict[tuple[str, str], bool] = {}

    def matches(self, pattern: regex.Pattern[str], name: str, what: str, param: str) -> bool:
        """Whether `pattern` matches all of `name`; `what` names the config's pattern."""
        key = (pattern.pattern, name)
        if key in self._known:
            return self._known[key]
        start = time.perf_counter()
        try:
            left = self.budget_s - self._spent_s
            if left <= 0:
                raise TimeoutError
            found = pattern.fullmatch(name, timeout=left, concurrent=True) is not None
        except TimeoutError as e:
            raise invalid(
                "bad_config",
                f"{CONFIG_FILE}: {what} took more than {self.budget_s} s in all to match the "
                f"module names (at {excerpt(name)}): it backtracks too much",
                param,
            ) from e
        finally:
            self._spent_s += time.perf_counter() - start
        self._known[key] = found
        return found


_BACKREFERENCE = regex.compile(r"\\[1-9]|\(\?P=|\\g<")


def rank_for(ranks: dict[str, int], module: str, clock: PatternClock) -> int:
    return pattern_value(ranks, module, clock, "rank_pattern")


def pattern_value(values: dict[str, V], module: str, clock: PatternClock, param: str) -> V:
    """`values[""]` unless a key of `values` (a `param` pattern) matches `module`. vLLM's (and
    PEFT's) rule: the first pattern that is a '.'-bounded suffix of the name wins."""
    keys = tuple(key for key in values if key)
    any_key, suffixes = _suffix_patterns(keys)
    if any_key is not None and not clock.matches(
        any_key, module, f"{param} keys {excerpt(list(keys))}", param
    ):
        return values[""]
    for key, suffix in zip(keys, suffixes, strict=True):
        if clock.matches(suffix, module, f"{param} key {excerpt(key)}", param):
            return values[key]
    return values[""]


@functools.lru_cache(maxsize=64)
def _suffix_patterns(
    keys: tuple[str, ...],
) -> tuple[regex.Pattern[str] | None, tuple[regex.Pattern[str], ...]]:
    """Each key as a '.'-bounded suffix pattern, and all of them at once, built once per
    adapter's keys (rank_for runs per tensor). The all-at-once pattern goes first: most modules
    of a large adapter match no key, and a match with a timeout costs ~4 us whatever the
    pattern (18,624 modules with 48 keys: 1.8 s against 12.6 s key by key). Exact, unless a key
    refers to a group, which the alternation renumbers: then None."""
    suffixes = tuple(regex.compile(rf"(.*\.)?({key})") for key in keys)
    if not keys or _BACKREFERENCE.search("".join(keys)):
        return None, suffixes
    return regex.compile(rf"(.*\.)?(?:{'|'.join(f'(?:{k})' for k in keys)})"), suffixes


def _check_target_regex(targets: str, spec: BaseModelSpec, clock: PatternClock) -> None:
    pattern = _compile(targets, "target_modules regex", "target_modules")
    what = f"target_modules regex {excerpt(targets)}"
    if not any(clock.matches(pattern, m, what, "target_modules") for m in spec.linear):
        raise invalid(
            "target_modules",
            f"target_modules regex {excerpt(targets)} matches no linear module of {spec.name}",
            "target_modules",
        )


def _check_targets(config: dict[str, Any], spec: BaseModelSpec, clock: PatternClock) -> None:
    if "target_modules" not in config:  # vLLM requires the key (PEFT writes null for none)
        raise invalid("bad_config", f"{CONFIG_FILE}: target_modules is missing", "target_modules")
    targets = config["target_modules"]
    if isinstance(targets, str):
        if targets != "all-linear":
            _check_target_regex(targets, spec, clock)
    elif isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str) or not spec.matches_target(target):
                raise invalid(
                    "target_modules",
                    f"target module {excerpt(target)} is not a linear module of {spec.name} "
                    "that can take LoRA (only decoder-layer linears can)",
                    "target_modules",
                )
    elif targets is not None or not config.get("target_parameters"):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: target_modules must be a list or a regex string",
            "target_modules",
        )  # fmt: skip
    params = config.get("target_parameters") or []
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise invalid(
            "bad_config", f"{CONFIG_FILE}: target_parameters must be a list of strings",
            "target_parameters",
        )  # fmt: skip
    for param in params:
        if spec.moe is None or param.rsplit(".", 1)[-1] not in ("gate_up_proj", "down_proj"):
            raise invalid(
                "target_modules",
                f"target parameter {excerpt(param)}: {spec.name} has no fused MoE expert parameter "
                "of that name (supported: experts.gate_up_proj, experts.down_proj)",
                "target_parameters",
            )


def check_config(
    folder: Path, spec: BaseModelSpec, max_lora_rank: int, clock: PatternClock
) -> CheckedConfig:
    """Validate the config; return its ranks and alphas."""
    config = _load_config(folder)
    if config.get("peft_type") != "LORA":
        raise invalid(
            "not_lora", f"peft_type is {excerpt(config.get('peft_type'))}; only 'LORA' is served",
            "peft_type",
        )  # fmt: skip
    _check_features(config)
    _check_pattern_sizes(config)
    ranks = _check_rank(config, max_lora_rank)
    alphas = _check_alpha(config)
    _check_targets(config, spec, clock)
    return CheckedConfig(ranks, alphas, bool(config.get("use_rslora")))
