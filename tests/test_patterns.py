"""torchq.patterns: regular expressions from files matched in linear time, with ``re``'s truth values;
pathological patterns finish, unsupported constructs and huge automata are refused, and the
compressed-tensors and ``quantize_`` plan paths use it."""

from __future__ import annotations

import contextlib
import re
import signal
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import torchq
from torchq.interop.compressed_tensors import _scheme_for, parse_quantization_config
from torchq.patterns import MAX_STATES, PatternError, SafePattern, compile_pattern


@contextlib.contextmanager
def no_hang(seconds: int = 10):
    """Fails only on a hang (no timing assertion): SIGALRM after ``seconds``."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def boom(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def agree(pattern: str, text: str) -> None:
    sp = compile_pattern(pattern, where="test")
    for fn in ("match", "fullmatch", "search"):
        want = getattr(re, fn)(pattern, text) is not None
        assert getattr(sp, fn)(text) == want, (fn, pattern, text)


# -- agreement with re on random patterns ------------------------------------------------------------------
ATOMS = ["a", "b", "A", "_", " ", r"\.", ".", r"\n", "[ab]", "[^a]", "[a-b]", "[.]", "[^\\s]", "[A-Za]", r"\w", r"\W",
         r"\d", r"\s", r"\S", "^", "$", r"\A", r"\Z", r"\b", r"\B", "(?:)"]
QUANTIFIERS = ["*", "+", "?", "{2}", "{1,3}", "{,2}", "{2,}", "{0}", "{0,1}"]
TEXT = "ab.A_ 1\n"


def _repeat(draw_child: str, q: str, lazy: bool) -> str:
    return f"(?:{draw_child}){q}{'?' if lazy else ''}"


patterns = st.recursive(
    st.sampled_from(ATOMS),
    lambda child: st.one_of(
        st.lists(child, min_size=2, max_size=3).map("".join),
        st.lists(child, min_size=2, max_size=3).map(lambda alts: "(?:" + "|".join(alts) + ")"),
        st.tuples(st.sampled_from(["(", "(?:", "(?i:", "(?s:", "(?m:", "(?a:", "(?-i:"]), child).map(lambda t: t[0] + t[1] + ")"),
        st.builds(_repeat, child, st.sampled_from(QUANTIFIERS), st.booleans()),
    ),
    max_leaves=8,
)
flagged = st.tuples(st.sampled_from(["", "", "(?i)", "(?s)", "(?m)", "(?a)", "(?ims)", "(?x)"]), patterns).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern=flagged, texts=st.lists(st.text(alphabet=TEXT, max_size=7), min_size=1, max_size=6))
def test_random_patterns_agree_with_re(pattern, texts) -> None:
    try:
        re.compile(pattern)
    except re.error:
        with pytest.raises(PatternError, match="invalid|nothing to repeat|multiple repeat|bad"):
            compile_pattern(pattern, where="test")
        return
    for text in texts:
        agree(pattern, text)


@pytest.mark.parametrize("pattern", [
    ".*mlp.*", r".*self_attn.(q|k|v)_proj$", r"model\.layers\.\d+\.mlp\.down_proj", ".*lm_head", "(?i).*LM_HEAD",
    r".*mlp.(gate|up)_proj$", r"^model\.layers\.[0-9]{1,2}\.", r"\bproj\b", r"(?s).*\Z", r".*\.(?P<w>weight|bias)$",
    r"layers\.(?:1[0-5]|[02-9])\.", "(?a)\\w+", "(?i)[k-l]", "(?i)s", r"[\d\s]+", r"\D\W\S",
])
def test_real_world_patterns_agree_with_re(pattern) -> None:
    texts = ["", "lm_head", "LM_HEAD", "model.lm_head", "model.layers.12.mlp.down_proj", "model.layers.3.self_attn.k_proj",
             "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.gate_proj\n",
             "x.proj.y", "xproj", "layers.7.", "layers.11.", "layers.16.", "a.weight", "b.bias\n", "\u212a", "\u017f",
             "ǅ", "٣ ٤", "Ⅻ", "\u0130", "straße", "K"]
    for text in texts:
        agree(pattern, text)


def test_non_ascii_and_anchor_corner_cases() -> None:
    for pattern, texts in [
        (r"\b", ["", "a", " ", "a b"]), (r"\B", ["", "a", " ", "ab", " a"]), ("(?a)\\b.", ["é", "éa", "a"]),
        ("a$", ["a", "a\n", "a\n\n", "ab"]), ("(?m)a$\\n^b", ["a\nb", "a\n\nb"]), (r"a\Z", ["a", "a\n"]),
        ("(?i)[^k]", ["\u212a", "k", "K", "x"]), ("(?i)\u00df", ["\u1e9e", "SS", "ß"]), (".", ["\n", "\r", "\U0001f600"]),
        ("[\U0001f600-\U0001f64f]+", ["\U0001f601\U0001f602", "a"]),
        ("(?:a|\\b)*b", ["aab", "b", " b"]), ("(?:a?){3,}b", ["b", "ab", "aaaab"]), ("(?:(?:a*)*)*$", ["aaa", "aab"]),
    ]:
        for text in texts:
            agree(pattern, text)
    sp = compile_pattern("(?:){1000000000}x", where="test")  # re itself runs out of memory on this one
    assert sp.fullmatch("x") and not sp.match("") and sp.num_states == 2


# -- bounded time and size ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern, expected", [  # (match, fullmatch, search) of a*10_000, a*10_000 + "!", "Z" + a*10_000
    ("(.|.)*Z", "FFF FFF TFT"), ("(a+)+$", "TTT FFF FFT"), ("(a|aa)*b", "FFF FFF FFF"), ("(.*a){20}", "TTT TFT TTT"),
    ("(?:a*)*b", "FFF FFF FFF"), (r"(\w+\s?)*$", "TTT FFT TTT"),
])
def test_pathological_patterns_finish(pattern, expected) -> None:
    sp = compile_pattern(pattern, where="test")
    name = "a" * 10_000
    with no_hang():
        got = " ".join("".join("FT"[f(t)] for f in (sp.match, sp.fullmatch, sp.search)) for t in (name, name + "!", "Z" + name))
    assert got == expected
    with no_hang():  # re agrees where it is still fast
        for t in ("a" * 10, "a" * 10 + "!", "Z" + "a" * 4):
            agree(pattern, t)


@pytest.mark.parametrize("pattern, construct", [
    (r"(a)\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"), ("(?=a)", "lookahead"), ("a(?!b)", "negative lookahead"),
    ("(?<=a)b", "lookbehind"), ("(?<!a)b", "negative lookbehind"), ("(a)?(?(1)a|b)", "conditional"),
    ("(?>a+)b", "atomic group"), ("a*+", "possessive"), ("a{1,3}+", "possessive"),
])
def test_unsupported_constructs_are_refused(pattern, construct) -> None:
    with pytest.raises(PatternError, match=construct) as e:
        compile_pattern(pattern, where="quantization_config.ignore")
    assert e.value.where == "quantization_config.ignore" and e.value.pattern == pattern
    assert str(e.value).startswith(f"quantization_config.ignore: regular expression {pattern!r}")


def test_invalid_patterns_keep_re_message() -> None:
    for pattern in ["(?(1)a|b)", "(", "a{2,1}", "[b-a]", "a{1000}{1000}", "*"]:
        with pytest.raises(re.error) as want:
            re.compile(pattern)
        with pytest.raises(PatternError) as got:
            compile_pattern(pattern, where="here")
        assert isinstance(got.value, ValueError) and got.value.reason == str(want.value)
        assert str(got.value) == f"here: regular expression {pattern!r}: {want.value}"


@pytest.mark.parametrize("pattern", ["(?:a{1000}){1000}", "(?:(?:a{100}){100}){100}", "a{20000}", "(?:a|b){5000,9000}",
                                     "x{0,4294967294}", "(?:(?:(?:.*){99}){99}){99}"])
def test_huge_automata_are_refused(pattern) -> None:
    with no_hang(), pytest.raises(PatternError, match=f"exceed {MAX_STATES} states"):
        compile_pattern(pattern, where="test")


def test_long_and_deep_patterns_are_refused() -> None:
    with pytest.raises(PatternError, match="longer than 4096 characters") as e:
        compile_pattern("a" * 5000, where="test")
    assert len(str(e.value)) < 400  # the message shows the start of the pattern only
    for depth in (150, 5000):
        with no_hang(), pytest.raises(PatternError, match="nested deeper|longer than"):
            compile_pattern("(" * depth + "a" + ")" * depth, where="test")
    with pytest.raises(PatternError, match="expected a str"):
        compile_pattern(b"a", where="test")  # type: ignore[arg-type]
    assert isinstance(compile_pattern("(" * 50 + "a" + ")" * 50, where="test"), SafePattern)
    with pytest.raises(TypeError):
        compile_pattern("a", where="test").match(b"a")  # type: ignore[arg-type]


def test_compiled_patterns_are_cached_and_describe_themselves() -> None:
    sp = compile_pattern(".*mlp.*", where="a")
    assert compile_pattern(".*mlp.*", where="b") is sp and sp.pattern == ".*mlp.*" and "mlp" in repr(sp)


# -- wired in ------------------------------------------------------------------------------------------------
def _ct_config(ignore: list[str], targets: list[str]) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ignore,
            "config_groups": {"group_0": {"targets": targets, "weights": weights}}}


def test_compressed_tensors_hostile_ignore_pattern() -> None:
    cfg = parse_quantization_config(_ct_config(["re:(.|.)*Z", "lm_head"], ["re:.*self_attn.(q|k|v)_proj$", "Linear"]))
    long = "model.layers.0." + "a" * 10_000
    with no_hang():
        assert _scheme_for(long + "Z", cfg, None) == (None, None)  # ignored
        assert _scheme_for("lm_head", cfg, None) == (None, None)
        scheme, target = _scheme_for(long, cfg, None)
        assert scheme is not None and target == "Linear"
        scheme, target = _scheme_for("model.layers.0.self_attn.k_proj", cfg, None)
        assert target == "re:.*self_attn.(q|k|v)_proj$"
        assert _scheme_for("model.layers.0.self_attn.k_projZ", cfg, None) == (None, None)  # re.match: ends anywhere


@pytest.mark.parametrize("where, config", [
    ("quantization_config.ignore", _ct_config(["re:(?<=a)b"], ["Linear"])),
    ("quantization_config.config_groups['group_0'].targets", _ct_config([], ["Linear", r"re:(a)\1"])),
    ("quantization_config.config_groups['group_0'].targets", _ct_config([], ["re:(unclosed"])),
])
def test_compressed_tensors_refuses_unsupported_patterns(where, config) -> None:
    with pytest.raises(ValueError, match=re.escape(where) + ": regular expression"):
        parse_quantization_config(config)


def test_quantize_plan_with_hostile_pattern() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with no_hang(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pattern matches no module
        torchq.quantize_(m, {"re:(.|.)*Z": None, "_default": torchq.int8_weight_only()})
    assert isinstance(m[0].weight, torchq.AffineQuantizedTensor) and isinstance(m[2].weight, torchq.AffineQuantizedTensor)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    torchq.quantize_(m, {"re:(0|1)+": None, "_default": torchq.int8_weight_only()})
    assert not isinstance(m[0].weight, torchq.AffineQuantizedTensor) and isinstance(m[2].weight, torchq.AffineQuantizedTensor)
    with pytest.raises(ValueError, match=r"config\['re:\(a\)\\\\1'\]: invalid regular expression: a backreference"):
        torchq.quantize_(nn.Sequential(nn.Linear(64, 64)), {r"re:(a)\1": None})
    with pytest.raises(ValueError, match="invalid regular expression: missing \\)"):
        torchq.quantize_(nn.Sequential(nn.Linear(64, 64)), {"re:(": None})
