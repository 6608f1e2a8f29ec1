"""Chapter 02's checks pass on the reference answers and fail, with the right hint, on wrong ones."""
import math
import time

import pytest
import torch

from companion import floats
from companion.checks import ch02
from companion.checks.core import CheckFailed


# ---------------------------------------------------------------- answers a learner might write

def decode_bf16(bits):
    sign = -1.0 if bits >> 15 else 1.0
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if exponent == 0xFF:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa / 2**7 * 2.0 ** (1 - 127)
    return sign * (1 + mantissa / 2**7) * 2.0 ** (exponent - 127)


def max_finite(e, m, finite_only):
    bias = 2 ** (e - 1) - 1
    if finite_only:                       # top exponent holds numbers; S.1..1.1..1 is NaN
        return (2 - 2.0 ** (1 - m)) * 2.0 ** (2**e - 1 - bias)
    return (2 - 2.0**-m) * 2.0 ** (2**e - 2 - bias)


def largest_exact_integer(e, m):
    return min(2 ** (m + 1), math.floor(max_finite(e, m, False)))


def low_precision_sum(values, dtype):
    total = torch.zeros((), dtype=dtype)
    for v in values.to(dtype):
        total = total + v
    return total


def rounding_threshold(w, e, m):
    bias = 2 ** (e - 1) - 1
    power = max(math.floor(math.log2(w)), 1 - bias)
    return 2.0 ** (power - m) / 2


REFERENCES = [
    (ch02.check_decode_bf16, decode_bf16),
    (ch02.check_max_finite, max_finite),
    (ch02.check_largest_exact_integer, largest_exact_integer),
    (ch02.check_low_precision_sum, low_precision_sum),
    (ch02.check_rounding_threshold, rounding_threshold),
]
IDS = [check.__name__ for check, _ in REFERENCES]


@pytest.mark.parametrize("check, answer", REFERENCES, ids=IDS)
def test_reference_answers_pass(check, answer, capsys):
    check(answer)
    assert "passed" in capsys.readouterr().out


def test_numpy_numbers_are_numbers():
    np = pytest.importorskip("numpy")
    ch02.check_decode_bf16(lambda bits: np.float32(decode_bf16(bits)))   # every bf16 is an fp32
    with pytest.raises(CheckFailed, match="expected a number"):
        ch02.check_decode_bf16(lambda bits: np.bool_(True))


def test_the_package_reference_passes_too():
    ch02.check_decode_bf16(lambda bits: floats.decode(bits, "bf16"))
    ch02.check_low_precision_sum(floats.running_sum)
    ch02.check_rounding_threshold(
        lambda w, e, m: floats.ulp(w, floats.FloatFormat("layout", e, m)) / 2)


# ---------------------------------------------------------------- known-wrong answers

def _no_implicit_one(bits):
    value = decode_bf16(bits)
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if 0 < exponent < 0xFF:
        return math.copysign(mantissa / 2**7 * 2.0 ** (exponent - 127), value)
    return value


def _subnormal_as_normal(bits):
    if (bits >> 7) & 0xFF == 0 and bits & 0x7F:
        return math.copysign((1 + (bits & 0x7F) / 2**7) * 2.0**-127, decode_bf16(bits))
    return decode_bf16(bits)


def _zero_as_normal(bits):
    """Subnormals right, but an all-zero field read as a normal number: zero becomes ±2^-127."""
    if bits & 0x7FFF == 0:
        return math.copysign(2.0**-127, -1.0 if bits >> 15 else 1.0)
    return decode_bf16(bits)


def _flush_subnormals(bits):
    """Subnormals flushed to zero, as some hardware does for speed."""
    if (bits >> 7) & 0xFF == 0:
        return math.copysign(0.0, decode_bf16(bits))
    return decode_bf16(bits)


def _mantissa_over_127(bits):
    """Normals with the mantissa divided by 127 instead of 2^7."""
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if 0 < exponent < 0xFF:
        return math.copysign((1 + mantissa / 127) * 2.0 ** (exponent - 127), decode_bf16(bits))
    return decode_bf16(bits)


def _subnormal_mantissa_over_127(bits):
    """Normals right; subnormals with the mantissa divided by 127 instead of 2^7."""
    if (bits >> 7) & 0xFF == 0:
        return math.copysign((bits & 0x7F) / 127 * 2.0**-126, decode_bf16(bits))
    return decode_bf16(bits)


def _inf_without_sign(bits):
    return math.inf if bits == 0xFF80 else decode_bf16(bits)


def _nan_for_inf(bits):
    return math.nan if bits & 0x7FFF == 0x7F80 else decode_bf16(bits)


def test_unlisted_mistakes_get_the_rule_of_their_kind_of_pattern():
    """A mistake no known-wrong value explains gets the rule for the kind of pattern that failed
    (normal, subnormal, inf/NaN), never another kind's."""
    for answer, failing, rule, not_this in [
            (_mantissa_over_127, "0x3dcd", "a normal pattern", "inf"),
            (_subnormal_mantissa_over_127, "0x0001", "is a subnormal", "inf"),
            (_nan_for_inf, "0x7f80", "inf (mantissa 0) or NaN", "subnormal")]:
        with pytest.raises(CheckFailed) as failure:
            ch02.check_decode_bf16(answer)
        assert failing in failure.value.summary, (answer.__name__, failure.value.summary)
        assert rule in failure.value.hint and not_this not in failure.value.hint, (
            answer.__name__, failure.value.hint)


def _signalling_nan_as_inf(bits):
    """NaN only when the quiet bit is set: 0x7F81..0x7FBF read as infinities."""
    if (bits >> 7) & 0xFF == 0xFF and bits & 0x7F and not bits & 0x40:
        return math.copysign(math.inf, -1.0 if bits & 0x8000 else 1.0)
    return decode_bf16(bits)


def _negative_nan_as_inf(bits):
    if bits & 0x8000 and (bits >> 7) & 0xFF == 0xFF:
        return -math.inf
    return decode_bf16(bits)


def _canonical_nan_only(bits):
    """NaN only for the patterns torch makes (0x7FC0, 0xFFC0): every other NaN read as ±inf."""
    if (bits >> 7) & 0xFF == 0xFF and bits & 0x7F and bits & 0x7F != 0x40:
        return math.copysign(math.inf, -1.0 if bits & 0x8000 else 1.0)
    return decode_bf16(bits)


@pytest.mark.parametrize("wrong", [_signalling_nan_as_inf, _negative_nan_as_inf,
                                   _canonical_nan_only])
def test_nans_of_every_kind_are_fixed_patterns(wrong):
    # passed 37 of 40 runs when only 0x7FC0 was fixed (39, 40 and 35 of 40 at the review's
    # commit, in the order above)
    for _ in range(20):
        with pytest.raises(CheckFailed, match="NaN"):
            ch02.check_decode_bf16(wrong)


def test_a_wrong_zero_gets_the_zero_branch_hint_not_the_sign_hint():
    with pytest.raises(CheckFailed, match="no implicit leading 1") as failure:
        ch02.check_decode_bf16(_zero_as_normal)
    assert "sign bit" not in str(failure.value)


def _hang(*args):
    while True:
        time.sleep(0.01)


WRONG = [
    (ch02.check_decode_bf16, _no_implicit_one, "implicit leading 1"),
    (ch02.check_decode_bf16, lambda b: decode_bf16(b) / 2 if (b >> 7) & 0xFF not in (0, 0xFF)
     else decode_bf16(b), "bias is 127"),
    (ch02.check_decode_bf16, lambda b: abs(decode_bf16(b)), "sign"),
    (ch02.check_decode_bf16, _subnormal_as_normal, "subnormal"),
    (ch02.check_decode_bf16, _flush_subnormals, "subnormals are not zero"),
    (ch02.check_decode_bf16, _inf_without_sign, "0xff80 is -inf"),
    (ch02.check_decode_bf16, lambda b: decode_bf16(b) if (b >> 7) & 0xFF != 0xFF else 0.0,
     "inf (mantissa 0) or NaN"),
    (ch02.check_decode_bf16, lambda b: abs(decode_bf16(b)) if b == 0x8000 else decode_bf16(b),
     "-0.0"),
    (ch02.check_max_finite, lambda e, m, fn: max_finite(e, m, False), "only its all-ones mantissa"),
    (ch02.check_max_finite, lambda e, m, fn: (2 - 2.0**-m) * 2.0 ** (2**e - 1 - (2 ** (e - 1) - 1))
     if fn else max_finite(e, m, fn), "NaN pattern"),
    (ch02.check_max_finite, lambda e, m, fn: (2 - 2.0**-m) * 2.0 ** (2**e - 1 - (2 ** (e - 1) - 1))
     if e < 11 else math.inf, "reserved for inf and NaN"),
    (ch02.check_max_finite, lambda e, m, fn: 2.0 ** (2**e - 2 - (2 ** (e - 1) - 1)), "include it"),
    (ch02.check_max_finite, lambda e, m, fn: max_finite(e, m, fn) / 2, "bias is 2^(e−1) − 1"),
    (ch02.check_largest_exact_integer, lambda e, m: 2 ** (m + 1), "run out before the precision"),
    (ch02.check_largest_exact_integer, lambda e, m: min(2**m, largest_exact_integer(e, m)),
     "implicit leading 1"),
    (ch02.check_largest_exact_integer, lambda e, m: largest_exact_integer(e, m) - 1
     if largest_exact_integer(e, m) == 2 ** (m + 1) else largest_exact_integer(e, m), "itself is exact"),
    (ch02.check_largest_exact_integer, lambda e, m: math.floor(min(max_finite(e, m, False), 2.0**1000)),
     "gap between neighbours is 2"),
    (ch02.check_low_precision_sum, lambda v, d: v.to(d).sum(), "wider accumulator"),
    (ch02.check_low_precision_sum, lambda v, d: v.to(d).cumsum(0)[-1], ".sum(), cumsum"),
    (ch02.check_low_precision_sum, lambda v, d: floats.running_sum(v, d, accumulate=torch.float32),
     "wider accumulator"),
    (ch02.check_low_precision_sum, lambda v, d: low_precision_sum(v, d).float(), "dtype"),
    (ch02.check_low_precision_sum, lambda v, d: low_precision_sum(v, d).reshape(1), "shape"),
    (ch02.check_rounding_threshold, lambda w, e, m: 2 * rounding_threshold(w, e, m), "half the gap"),
    (ch02.check_rounding_threshold, lambda w, e, m: 2.0 ** (-m - 1), "grows with the number"),
    (ch02.check_rounding_threshold, lambda w, e, m: w * 2.0 ** (-m - 1), "not w itself"),
    (ch02.check_rounding_threshold, lambda w, e, m: 2.0 ** (math.floor(math.log2(w)) - m - 1),
     "stops shrinking"),
    (ch02.check_rounding_threshold, lambda w, e, m: rounding_threshold(w, e, m) / 2
     if w == 2.0 ** math.floor(math.log2(w)) else rounding_threshold(w, e, m), "gap above"),
]


@pytest.mark.parametrize("check, answer, hint", WRONG,
                         ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(WRONG)])
def test_known_wrong_answers_fail_with_their_hint(check, answer, hint):
    with pytest.raises(CheckFailed) as failure:
        check(answer)
    assert hint in str(failure.value)


# ---------------------------------------------------------------- garbage in, CheckFailed out

def _raises(*args):
    raise RuntimeError("boom")


GARBAGE = [None, "decode", 42, _raises, lambda *a: None, lambda *a: "1.0", lambda *a: math.nan,
           lambda *a: torch.tensor([1.0, 2.0]), lambda *a: (1, 2)]


@pytest.mark.parametrize("check", [c for c, _ in REFERENCES], ids=IDS)
@pytest.mark.parametrize("answer", GARBAGE, ids=[f"garbage{i}" for i in range(len(GARBAGE))])
def test_garbage_fails_cleanly(check, answer):
    with pytest.raises(CheckFailed):
        check(answer)


@pytest.mark.parametrize("check", [c for c, _ in REFERENCES], ids=IDS)
def test_a_hang_fails_within_the_time_limit(check):
    start = time.monotonic()
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hang, timeout=0.3)
    assert time.monotonic() - start < 30        # stopped at the limit: slack for a loaded machine


def test_checks_draw_fresh_inputs(monkeypatch):
    """Two runs use different random patterns: a table of memorised answers does not pass."""
    seen = []
    ch02.check_decode_bf16(lambda bits: seen.append(bits) or decode_bf16(bits))
    first, seen[:] = list(seen), []
    ch02.check_decode_bf16(lambda bits: seen.append(bits) or decode_bf16(bits))
    assert first != seen


def test_exact_integer_reference_agrees_with_torch_and_with_every_pattern():
    import companion.checks.ch02 as c
    for dtype, (e, m) in [(torch.float16, (5, 10)), (torch.bfloat16, (8, 7)), (torch.float32, (8, 23))]:
        n = c._exact_integers(e, m)
        ints = torch.arange(n + 2, dtype=torch.float64)
        exact = ints.to(dtype).double() == ints
        assert bool(exact[: n + 1].all()) and not bool(exact[n + 1])
    for e, m in [(2, 1), (3, 2), (3, 4), (2, 3), (4, 3), (5, 2)]:   # every value of the layout
        f = floats.FloatFormat("layout", e, m)
        values = {floats.decode(bits, f) for bits in range(1 << f.bits)}
        n = next(k for k in range(10**6) if float(k) not in values) - 1
        assert c._exact_integers(e, m) == n, (e, m)


def test_max_finite_reference_agrees_with_torch():
    for dtype, (e, m, fn) in [(torch.float16, (5, 10, False)), (torch.bfloat16, (8, 7, False)),
                              (torch.float8_e4m3fn, (4, 3, True)), (torch.float8_e5m2, (5, 2, False)),
                              (torch.float64, (11, 52, False))]:
        assert max_finite(e, m, fn) == torch.finfo(dtype).max


def test_a_layout_answer_off_by_a_little_fails():
    """Exact comparison: an answer off in the last place for one layout does not pass."""
    with pytest.raises(CheckFailed):
        ch02.check_max_finite(lambda e, m, fn: max_finite(e, m, fn) * (1 + 2.0**-40 if e == 3 else 1))


@pytest.mark.parametrize("hint, answer", [
    ("stops shrinking", lambda w, e, m: 2.0 ** (math.floor(math.log2(w)) - m - 1)),
    ("not w itself", lambda w, e, m: w * 2.0 ** (-m - 1)),
])
def test_the_subnormal_case_names_one_mistake_in_every_draw(hint, answer):
    """A subnormal that is a power of two made both answers return the same wrong number, and
    the hint named whichever came first (failed CI once): the case is an odd multiple now."""
    for _ in range(20):
        with pytest.raises(CheckFailed) as failure:
            ch02.check_rounding_threshold(answer)
        assert hint in str(failure.value)


def _values_added_unrounded(values, dtype):
    total = torch.zeros((), dtype=dtype)
    for v in values:
        total += v                  # the fp32 value as given, the sum rounded to dtype
    return total


def test_values_added_unrounded_fail_every_run_on_the_double_rounding_case():
    # passed 15 of 40 runs at the review's commit; failed the others with ".sum() adds in a wider
    # accumulator" or no hint at all
    for _ in range(20):
        with pytest.raises(CheckFailed, match="round each value to the dtype before adding"):
            ch02.check_low_precision_sum(_values_added_unrounded)


def test_the_references_of_exercises_1_and_4_pass_every_run():
    for _ in range(20):
        ch02.check_decode_bf16(decode_bf16)
        ch02.check_low_precision_sum(low_precision_sum)
