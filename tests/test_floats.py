"""companion.floats against PyTorch's own casts: every 8- and 16-bit pattern, ties, random fp32."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from companion import floats
from companion.floats import FORMATS, decode, encode

NARROW = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
UNSIGNED = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def same(a: float, b: float) -> bool:
    """Equal as floats, the sign of zero included; any NaN equals any NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def all_patterns(name: str) -> list[int]:
    return list(range(2 ** FORMATS[name].bits))


def torch_values(patterns: list[int], name: str) -> list[float]:
    """What PyTorch reads from these bit patterns in `name`'s dtype."""
    f = FORMATS[name]
    ints = torch.tensor(patterns, dtype=torch.int64).to(UNSIGNED[f.bits])   # wraps to the width
    return ints.view(f.dtype).double().tolist()


def torch_bits(values: torch.Tensor, name: str) -> list[int]:
    """The bit patterns PyTorch stores when it casts `values` to `name`'s dtype."""
    f = FORMATS[name]
    ints = values.to(f.dtype).view(UNSIGNED[f.bits]).to(torch.int64)
    return (ints & (2**f.bits - 1)).tolist()


def random_fp32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=g).to(torch.int32).view(
        torch.float32)


def assert_encodes_like_torch(values: torch.Tensor, name: str) -> None:
    expected = torch_bits(values, name)
    for x, want in zip(values.double().tolist(), expected):
        got = encode(x, name)
        if math.isnan(x):
            assert math.isnan(decode(got, name)) and math.isnan(decode(want, name))
        else:
            assert got == want, f"{name}: encode({x!r}) = {got:#x}, torch stores {want:#x}"


# ---------------------------------------------------------------- the format records

@pytest.mark.parametrize("name", list(FORMATS))
def test_format_record_matches_finfo(name):
    f, info = FORMATS[name], torch.finfo(FORMATS[name].dtype)
    assert f.bits == info.bits == 8 * f.bytes
    assert (f.max, f.min_normal, f.eps) == (info.max, info.smallest_normal, info.eps)
    smallest = torch_values([1], name)[0]
    assert f.min_subnormal == smallest == decode(1, name)
    assert f.bias == 2 ** (f.exponent_bits - 1) - 1


def test_layouts_are_the_standard_ones():
    layout = {n: (f.exponent_bits, f.mantissa_bits) for n, f in FORMATS.items()}
    assert layout == {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7),
                      "fp8_e4m3": (4, 3), "fp8_e5m2": (5, 2)}
    assert FORMATS["fp16"].max == 65504 and FORMATS["fp8_e4m3"].max == 448
    assert FORMATS["bf16"].max == pytest.approx(FORMATS["fp32"].max, rel=2**-7)


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("name", NARROW)
def test_decode_every_pattern_like_torch(name):
    patterns = all_patterns(name)
    for bits, want in zip(patterns, torch_values(patterns, name)):
        assert same(decode(bits, name), want), f"{name} {bits:#x}"


def test_decode_random_and_special_fp32_patterns_like_torch():
    special = [0, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000,
               0x80000000, 0x80000001, 0xFF800000]
    g = torch.Generator().manual_seed(0)
    patterns = special + torch.randint(0, 2**32, (20000,), generator=g).tolist()
    for bits, want in zip(patterns, torch_values(patterns, "fp32")):
        assert same(decode(bits, "fp32"), want), f"fp32 {bits:#x}"


@pytest.mark.parametrize("bad", [-1, 2**16, 1.5, "7"])
def test_decode_rejects_patterns_outside_the_format(bad):
    with pytest.raises((ValueError, TypeError)):
        decode(bad, "fp16")


def test_unknown_format_says_which_exist():
    with pytest.raises(ValueError, match="fp16"):
        decode(0, "fp12")


# ---------------------------------------------------------------- encode

@pytest.mark.parametrize("name", NARROW)
def test_encode_every_8_and_16_bit_value_like_torch(name):
    """Every fp16, bf16 and fp8 value as fp32: exact values, specials, and far out of range."""
    values = []
    for source in ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]:
        values += torch_values(all_patterns(source), source)
    assert_encodes_like_torch(torch.tensor(values, dtype=torch.float32), name)


@pytest.mark.parametrize("name", NARROW)
def test_encode_ties_and_their_neighbours_like_torch(name):
    """Midway between neighbours the cast rounds to the even one; one fp32 ulp off, to the nearer."""
    f = FORMATS[name]
    finite = [decode(b, name) for b in range(2 ** (f.bits - 1)) if math.isfinite(decode(b, name))]
    mids = [(a + b) / 2 for a, b in zip(finite, finite[1:])]
    mids.append(f.max + ulp_at_max(name) / 2)        # the tie with overflow
    mids = torch.tensor(mids + [-m for m in mids], dtype=torch.float32)
    for values in (mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, mids * 0)):
        assert_encodes_like_torch(values, name)


def ulp_at_max(name: str) -> float:
    return floats.ulp(FORMATS[name].max, name)


@pytest.mark.parametrize("name", NARROW)
def test_encode_random_fp32_like_torch(name):
    assert_encodes_like_torch(random_fp32(20000, seed=1), name)


@pytest.mark.parametrize("name", ["fp32"] + NARROW)
def test_encode_doubles_like_torch(name):
    """Python floats are doubles: PyTorch casts them through fp32 (rounding twice), so does encode."""
    g = torch.Generator().manual_seed(2)
    base = random_fp32(3000, seed=3).double()
    base = base[torch.isfinite(base)]
    nudged = base * (1 + (torch.rand(len(base), generator=g, dtype=torch.float64) - 0.5) * 2**-20)
    f = FORMATS[name]
    ties = torch.tensor([1 + 2.0 ** -(f.mantissa_bits + 1) * (1 + 2**-40)], dtype=torch.float64)
    for values in (nudged, ties):
        assert_encodes_like_torch(values, name)
    x = ties.item()      # torch.tensor(python_float, dtype=...) rounds the same way
    assert encode(x, name) == torch_bits(torch.tensor([x], dtype=f.dtype), name)[0]


def test_encode_overflow_and_underflow_edges():
    assert decode(encode(65519.99, "fp16"), "fp16") == 65504
    assert decode(encode(65520, "fp16"), "fp16") == math.inf
    assert decode(encode(-1e6, "fp8_e4m3"), "fp8_e4m3") == -448     # saturates, as torch does
    assert decode(encode(math.inf, "fp8_e4m3"), "fp8_e4m3") == 448
    assert decode(encode(2.0**-25, "fp16"), "fp16") == 0             # the tie with 0 rounds to even
    assert decode(encode(2.0**-25 * 1.01, "fp16"), "fp16") == 2.0**-24
    assert encode(-0.0, "bf16") == 0x8000


@pytest.mark.parametrize("name", ["fp32"] + NARROW)
def test_encode_inverts_decode(name):
    f = FORMATS[name]
    patterns = all_patterns(name) if f.bits <= 16 else random_fp32(5000, 4).view(torch.int32).tolist()
    for bits in patterns:
        bits &= 2**f.bits - 1
        value = decode(bits, name)
        if not math.isnan(value):
            assert encode(value, name) == bits


@settings(max_examples=300, deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False),
       name=st.sampled_from(NARROW))
def test_rounding_error_is_at_most_half_an_ulp(x, name):
    f = FORMATS[name]
    if abs(x) >= f.max:
        return
    assert abs(decode(encode(x, name), name) - x) <= floats.ulp(x, name) / 2


# ---------------------------------------------------------------- ulp and fields

@pytest.mark.parametrize("name", NARROW)
def test_ulp_is_the_gap_to_the_next_pattern(name):
    f = FORMATS[name]
    for bits in range(2 ** (f.bits - 1)):
        here, nxt = decode(bits, name), decode(bits + 1, name)
        if math.isfinite(here) and math.isfinite(nxt):
            assert nxt - here == floats.ulp(here, name)
    assert floats.ulp(1.0, name) == f.eps
    assert math.isnan(floats.ulp(math.inf, name))


def test_ulp_fp32_matches_nextafter():
    x = random_fp32(5000, seed=5).abs()
    x = x[torch.isfinite(x) & (x < FORMATS["fp32"].max)]
    gaps = (torch.nextafter(x, torch.tensor(math.inf)) - x).double().tolist()
    for value, gap in zip(x.double().tolist(), gaps):
        assert floats.ulp(value, "fp32") == gap


@pytest.mark.parametrize("name", NARROW)
def test_fields_rebuild_the_value(name):
    f = FORMATS[name]
    for bits in all_patterns(name):
        fl = floats.fields_of_bits(bits, name)
        assert int(fl.binary.replace(" ", ""), 2) == bits
        assert [len(p) for p in fl.binary.split()] == [1, f.exponent_bits, f.mantissa_bits]
        if fl.kind in ("inf", "nan"):
            assert not math.isfinite(fl.value) and fl.power is None
            continue
        assert same((-1) ** fl.sign * fl.significand * 2.0**fl.power, fl.value)
        assert (fl.significand >= 1) == (fl.kind == "normal")


def test_fields_of_a_value_say_what_it_is():
    assert floats.fields(1.0, "fp16").binary == "0 01111 0000000000"
    assert str(floats.fields(-2.0, "bf16")) == "bf16 1 10000000 0000000 = -1.0 × 2^1 = -2.0 (normal)"
    assert floats.fields(1e-7, "fp16").kind == "subnormal"
    assert floats.fields(0.0, "fp16").kind == "zero"
    assert floats.fields(1e5, "fp16").kind == "inf"
    assert floats.fields(math.nan, "fp8_e4m3").kind == "nan"


# ---------------------------------------------------------------- the explorer's logic

@pytest.mark.parametrize("name", list(FORMATS))
def test_flip_bit_toggles_one_bit(name):
    f = FORMATS[name]
    one = encode(1.0, name)
    assert decode(floats.flip_bit(one, f.bits - 1, name), name) == -1.0
    assert decode(floats.flip_bit(one, f.mantissa_bits - 1, name), name) == 1.5
    assert decode(floats.flip_bit(one, f.mantissa_bits, name), name) == 0.5   # exponent's last bit
    for position in range(f.bits):
        assert floats.flip_bit(floats.flip_bit(one, position, name), position, name) == one
    with pytest.raises(ValueError):
        floats.flip_bit(one, f.bits, name)


def test_bit_roles():
    roles = floats.bit_roles("bf16")
    assert roles[0] == "sign" and roles.count("exponent") == 8 and roles[-7:] == ["mantissa"] * 7


def test_rounding_report():
    rows = {r["format"]: r for r in floats.rounding_report(0.1)}
    assert list(rows) == list(FORMATS)
    for name, row in rows.items():
        assert row["value"] == decode(encode(0.1, name), name)
        assert row["error"] == row["value"] - 0.1
        assert row["relative_error"] <= FORMATS[name].eps / 2
        assert row["bits"] == floats.fields(0.1, name).binary
    assert rows["fp16"]["note"] == "rounded (normal)"
    notes = {r["format"]: r["note"] for r in floats.rounding_report(1e5)}
    assert notes["fp16"] == "overflow to inf" and notes["fp8_e4m3"] == "saturated at ±448"
    assert notes["fp32"] == "exact"
    assert {r["note"] for r in floats.rounding_report(1e-30, ["fp16", "fp8_e5m2"])} == {
        "underflow to zero"}


# ---------------------------------------------------------------- sums and bytes

def test_running_sum_rounds_every_step():
    values = torch.full((1000,), 0.01)
    half = floats.running_sum(values, torch.float16)
    wide = floats.running_sum(values, torch.float16, accumulate=torch.float32)
    assert half.dtype == wide.dtype == torch.float16
    expected = torch.zeros((), dtype=torch.float16)
    for _ in range(1000):
        expected = expected + torch.tensor(0.01, dtype=torch.float16)
    assert torch.equal(half, expected)
    assert abs(wide.item() - 10) < abs(half.item() - 10)
    assert floats.running_sum(values, torch.float32).item() == pytest.approx(10, rel=1e-4)
    assert floats.running_sum(values[:0], torch.bfloat16).item() == 0


def test_running_totals_are_the_partial_sums():
    values = torch.rand(57, generator=torch.Generator().manual_seed(6))
    totals = floats.running_totals(values, torch.bfloat16, accumulate=torch.float32)
    assert totals.shape == (57,) and totals.dtype == torch.bfloat16
    for n in (1, 2, 30, 57):
        want = floats.running_sum(values[:n], torch.bfloat16, accumulate=torch.float32)
        assert torch.equal(totals[n - 1], want)
    stalled = floats.running_totals(torch.full((600,), 0.01), torch.bfloat16)
    assert stalled[-1].item() == 4.0 and bool((stalled[1:] >= stalled[:-1]).all())


def test_parameter_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    n = 3 * 5 + 5 + 5 + 1
    assert floats.parameter_bytes(model, torch.float32) == 4 * n
    assert floats.parameter_bytes(model, torch.bfloat16) == 2 * n
    assert floats.parameter_bytes(model, torch.float8_e5m2) == n


def test_float_explorer_wires_buttons_and_text_to_floats():
    pytest.importorskip("ipywidgets")
    from companion.widgets import float_explorer

    box = float_explorer(0.1, "bf16")
    (picker, typed), buttons, shown, table = box.children[0].children, box.children[1], *box.children[2:]
    assert len(buttons.children) == 16 and "0 01111011 1001101" in shown.value
    buttons.children[0].click()                                   # the sign bit
    assert typed.value == repr(-decode(encode(0.1, "bf16"), "bf16")) and "1 01111011" in shown.value
    typed.value = "70000"
    assert "overflow to inf" in table.value and "0 10001111 0001001" in shown.value
    picker.value = "fp8_e4m3"
    assert len(box.children[1].children) == 8 and "448.0" in shown.value
    typed.value = "not a number"
    assert "type a number" in shown.value
