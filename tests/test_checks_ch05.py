"""Chapter 05's checks pass on the reference and fail on known-wrong answers, each with its hint."""
import math

import pytest
import torch

from companion.checks.ch05 import (check_autocast_activation_bytes, check_bf16_layout,
                                   check_choose_scaling, check_replay_loss_scale, check_to_e4m3,
                                   check_unscale_grads)
from companion.checks.core import CheckFailed


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- a loss scale over a trace

def _grows_when(grows):
    """The notebook's solution with another test of whether the scale may grow."""
    def replay(amaxes, init_scale, growth_interval):
        scale, clean, steps = init_scale, 0, []
        for amax in amaxes:
            overflow = not torch.isfinite((torch.tensor(amax) * scale).half()).item()
            steps.append((scale, not overflow))
            if overflow:
                scale, clean = scale * 0.5, 0
            else:
                clean += 1
                if clean == growth_interval:
                    if grows(scale):
                        scale = scale * 2
                    clean = 0
        return steps
    return replay


# The notebook's solution: the scaled gradient rounded to fp16, GradScaler's rule.
replay_loss_scale = _grows_when(lambda scale: scale * 2 <= torch.finfo(torch.float32).max)


# bench_mutants' survivors (issue 54): each stops one growth short of float32's largest value,
# which a scale that is a power of two never reaches
_SHORT_OF_THE_TOP = {
    "<": lambda scale: scale * 2 < torch.finfo(torch.float32).max,
    "scale * 3 <=": lambda scale: scale * 3 <= torch.finfo(torch.float32).max,
    "bf16's largest": lambda scale: scale * 2 <= torch.finfo(torch.bfloat16).max,
    "3.4e38": lambda scale: scale * 2 < 3.4e38,
}


@pytest.mark.parametrize("test", _SHORT_OF_THE_TOP)
def test_replay_loss_scale_fails_a_growth_that_stops_short_of_the_top_every_time(test):
    for _ in range(20):
        with pytest.raises(CheckFailed, match="largest value / 8"):
            check_replay_loss_scale(_grows_when(_SHORT_OF_THE_TOP[test]))
        check_replay_loss_scale(_grows_when(lambda s: s * 2 <= torch.finfo(torch.float32).max))


def _python_floats(amaxes, init_scale, growth_interval):
    """Right too: fp16 overflows from 65520 on, tested in float64 arithmetic. (With 3.4e38 for
    float32's largest value, 3.4028e38, it stops one growth short of GradScaler from a scale of
    that value / 8, and fails: test_replay_loss_scale_fails_..._short_of_the_top.)"""
    top = torch.finfo(torch.float32).max
    scale, clean, steps = init_scale, 0, []
    for amax in amaxes:
        ok = math.isfinite(amax * scale) and abs(amax * scale) < 65520
        steps.append((scale, ok))
        scale, clean = (scale / 2, 0) if not ok else \
            ((scale * 2 if scale * 2 <= top else scale, 0) if clean + 1 == growth_interval
             else (scale, clean + 1))
    return steps


def _with(overflow=None, clean_after_skip=False, late=False, record_after=False,
          no_ceiling=False, no_reset=False, always_step=False):
    """A learner's replay with one thing wrong."""
    overflow = overflow or (lambda v: not math.isfinite(v) or abs(v) >= 65520)

    def replay(amaxes, init_scale, growth_interval):
        scale, clean, steps = init_scale, 0, []
        for amax in amaxes:
            bad = overflow(amax * scale)
            used = scale
            if bad:
                scale /= 2
                clean = clean if clean_after_skip else 0
            else:
                clean += 1
                if clean >= growth_interval + late:
                    if no_ceiling or scale * 2 < 3.4e38:
                        scale *= 2
                    clean = clean if no_reset else 0
            steps.append((scale if record_after else used, always_step or not bad))
        return steps
    return replay


def test_replay_loss_scale_reference_passes():
    from companion.amp import replay_scale
    for _ in range(5):
        check_replay_loss_scale(replay_loss_scale)
    check_replay_loss_scale(_python_floats)
    check_replay_loss_scale(replay_scale)
    check_replay_loss_scale(lambda a, s, n: [(torch.tensor(x), torch.tensor(f))
                                             for x, f in replay_scale(a, s, n)])


@pytest.mark.parametrize("wrong, hint", [
    (_with(overflow=lambda v: not math.isfinite(v) or abs(v) > 65504), "still rounds to 65504"),
    (_with(overflow=lambda v: abs(v) >= 65520), "NaN compares False"),
    (_with(overflow=lambda v: not math.isfinite(v)), "overflows where fp16 does"),
    (_with(clean_after_skip=True), "a skipped step is not a clean one"),
    (_with(late=True), "not one step later"),
    (_with(record_after=True), "the scale it had before the update"),
    (_with(no_ceiling=True), r"stored in float32 \(largest"),
    (_with(no_reset=True), "start counting again after the scale grows"),
    (_with(always_step=True), "must not step on inf or NaN"),
    (lambda a, s, n: replay_loss_scale(a, s, n)[:-1], "a list of"),
    (lambda a, s, n: [s for s, _ in replay_loss_scale(a, s, n)], "pair"),
    (lambda a, s, n: [(s, int(f)) for s, f in replay_loss_scale(a, s, n)], "True or False"),
])
def test_replay_loss_scale_wrong_answers_fail(wrong, hint):
    for _ in range(3):                               # fresh traces each time: the hint holds
        with pytest.raises(CheckFailed, match=hint):
            check_replay_loss_scale(wrong)


def _fp32_replay(past_65520=False, reset_when_blocked=True):
    """The independent review's replay (issue 54): the product amax * scale in float32, overflow
    from 65520 on (`past_65520`: only beyond it, the review's wrong answer); with
    `reset_when_blocked=False` the count is not reset when float32 stops the growth, an honest
    variant (no growth is possible until a backoff resets it)."""
    def replay(amaxes, init_scale, growth_interval):
        top, scale, clean, steps = torch.finfo(torch.float32).max, init_scale, 0, []
        for amax in amaxes:
            prod = float(torch.tensor(amax, dtype=torch.float32) *
                         torch.tensor(scale, dtype=torch.float32))
            over = not math.isfinite(prod) or (abs(prod) > 65520 if past_65520 else
                                               abs(prod) >= 65520)
            steps.append((scale, not over))
            if over:
                scale, clean = scale * 0.5, 0
            else:
                clean += 1
                if clean == growth_interval:
                    if scale * 2 <= top:
                        scale, clean = scale * 2, 0
                    elif reset_when_blocked:
                        clean = 0
        return steps
    return replay


def test_replay_loss_scale_fails_an_overflow_past_65520_every_time():
    """65520 is the tie between 65504 and 65536 that fp16 rounds up to inf (the review passed
    `> 65520` 11 of 11 runs: the traces had 65505-65519 and 65521-65530 but not 65520)."""
    assert torch.tensor(65520.0).half().isinf() and torch.tensor(65519.99).half() == 65504
    honest = [replay_loss_scale, _python_floats, _fp32_replay(),
              _fp32_replay(reset_when_blocked=False)]
    for _ in range(20):
        with pytest.raises(CheckFailed, match="exactly 65520"):
            check_replay_loss_scale(_fp32_replay(past_65520=True))
        for right in honest:
            check_replay_loss_scale(right)


def test_replay_loss_scale_failure_shows_the_skips():
    with pytest.raises(CheckFailed, match=r"S: skipped, expected [.S]+\)"):
        check_replay_loss_scale(_with(always_step=True))


# ---------------------------------------------------------------- unscale into the master, clipped

def unscale_grads(model_params, master_params, inv_scale, max_norm, *, device=True):
    """The notebook's solution; device=False makes the flag on the CPU whatever inv_scale's
    device."""
    found_inf = torch.zeros((), device=inv_scale.device) if device else torch.zeros(())
    for p, m in zip(model_params, master_params):
        if p.grad is None:
            continue
        found_inf += (~torch.isfinite(p.grad)).any()
        m.grad = p.grad.float().mul_(inv_scale)
    with_grads = [m for m in master_params if m.grad is not None]
    total_norm = torch.nn.utils.clip_grad_norm_(with_grads, max_norm)
    return found_inf > 0, total_norm


def _flag(model_params):
    return any(not bool(torch.isfinite(p.grad).all()) for p in model_params if p.grad is not None)


def _up(model_params, master_params, inv_scale, how=lambda g, inv: g.float() * inv):
    for p, m in zip(model_params, master_params):
        if p.grad is not None:
            m.grad = how(p.grad, inv_scale)
    return [m for m in master_params if m.grad is not None]


def _by_hand(model_params, master_params, inv_scale, max_norm):
    """Correct, without clip_grad_norm_: the norm in float64, the coefficient in Python."""
    grads = [m.grad for m in _up(model_params, master_params, inv_scale)]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
    for g in grads:
        g.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
    return _flag(model_params), norm


def _flag_from_the_norm(model_params, master_params, inv_scale, max_norm):
    """Correct here: the fp32 norm of fp16 gradients times at most 2 is finite unless one is not."""
    norm = torch.nn.utils.clip_grad_norm_(_up(model_params, master_params, inv_scale), max_norm)
    return not bool(torch.isfinite(norm)), norm


def _in_fp16(model_params, master_params, inv_scale, max_norm):
    live = _up(model_params, master_params, inv_scale, lambda g, inv: (g * inv.half()).float())
    return _flag(model_params), torch.nn.utils.clip_grad_norm_(live, max_norm)


def _looks_after_an_fp16_product(model_params, master_params, inv_scale, max_norm):
    found = any(not bool(torch.isfinite(p.grad * inv_scale.half()).all())
                for p in model_params if p.grad is not None)
    live = _up(model_params, master_params, inv_scale)
    return found, torch.nn.utils.clip_grad_norm_(live, max_norm)


def _fp16_sum(model_params, master_params, inv_scale, max_norm):
    found = any(not bool(torch.isfinite(p.grad.sum())) for p in model_params if p.grad is not None)
    return found, unscale_grads(model_params, master_params, inv_scale, max_norm)[1]


def _clip_then_unscale(model_params, master_params, inv_scale, max_norm, *, scaled_max=False):
    live = _up(model_params, master_params, inv_scale, lambda g, inv: g.float())
    norm = torch.nn.utils.clip_grad_norm_(live, max_norm / inv_scale.item() if scaled_max
                                          else max_norm)
    for m in live:
        m.grad.mul_(inv_scale)
    return _flag(model_params), norm * inv_scale


def _no_clip(model_params, master_params, inv_scale, max_norm):
    return unscale_grads(model_params, master_params, inv_scale, math.inf)


def _scaled_norm(model_params, master_params, inv_scale, max_norm):
    found, norm = unscale_grads(model_params, master_params, inv_scale, max_norm)
    return found, norm / inv_scale


def _norm_after_clipping(model_params, master_params, inv_scale, max_norm):
    found, _ = unscale_grads(model_params, master_params, inv_scale, max_norm)
    return found, torch.nn.utils.get_total_norm(
        [m.grad for m in master_params if m.grad is not None])


def _each_tensor_clipped(model_params, master_params, inv_scale, max_norm):
    found, norm = unscale_grads(model_params, master_params, inv_scale, math.inf)
    for m in master_params:
        if m.grad is not None:
            torch.nn.utils.clip_grad_norm_([m], max_norm)
    return found, norm


def _divides(model_params, master_params, inv_scale, max_norm):
    live = _up(model_params, master_params, inv_scale, lambda g, inv: g.float() / inv)
    return _flag(model_params), torch.nn.utils.clip_grad_norm_(live, max_norm)


def _isinf_only(model_params, master_params, inv_scale, max_norm):
    found = any(bool(p.grad.isinf().any()) for p in model_params if p.grad is not None)
    return found, unscale_grads(model_params, master_params, inv_scale, max_norm)[1]


def _first_only(model_params, master_params, inv_scale, max_norm):
    first = next(p.grad for p in model_params if p.grad is not None)
    return (not bool(torch.isfinite(first).all()),
            unscale_grads(model_params, master_params, inv_scale, max_norm)[1])


def _zero_for_the_missing(model_params, master_params, inv_scale, max_norm):
    for p in model_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return unscale_grads(model_params, master_params, inv_scale, max_norm)


def _new_tensors(model_params, master_params, inv_scale, max_norm):
    grads = [p.grad.float() * inv_scale for p in model_params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return _flag(model_params), norm


def test_unscale_grads_reference_passes():
    check_unscale_grads(unscale_grads)


@pytest.mark.parametrize("answer", [_by_hand, _flag_from_the_norm])
def test_unscale_grads_other_correct_answers_pass(answer):
    check_unscale_grads(answer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_unscale_grads_fails_a_flag_made_on_the_cpu_every_time():
    """`found_inf += ...` into a CPU flag from CUDA gradients: a CPU output beside a CUDA input."""
    for _ in range(5):
        with pytest.raises(CheckFailed):
            check_unscale_grads(lambda *args: unscale_grads(*args, device=False))


@pytest.mark.parametrize("wrong, hint", [
    (_in_fp16, "unscale in fp32"),
    (_looks_after_an_fp16_product, "before multiplying"),
    (_fp16_sum, "a sum of finite gradients can overflow"),
    (_clip_then_unscale, "clip the unscaled gradients"),
    (lambda *args: _clip_then_unscale(*args, scaled_max=True), "clip with max_norm itself"),
    (_no_clip, "clip to max_norm"),
    (_each_tensor_clipped, "all the gradients together"),
    (_scaled_norm, "the scaled one is scale times larger"),
    (_norm_after_clipping, "before clipping"),
    (_divides, "multiply by inv_scale"),
    (_isinf_only, "isinf misses NaN"),
    (_first_only, "every element of every gradient"),
    (_zero_for_the_missing, "keeps None"),
    (_new_tensors, "set master.grad"),
    (lambda *args: unscale_grads(*args)[0], r"\(found_inf, total_norm\)"),
    (lambda *args: (None, unscale_grads(*args)[1]), "found_inf as a number"),
])
def test_unscale_grads_wrong_answers_fail_every_time(wrong, hint):
    for _ in range(3):                          # fresh seeds each time: no draw lets one through
        with pytest.raises(CheckFailed, match=hint):
            check_unscale_grads(wrong)


# ---------------------------------------------------------------- which layout

STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def bf16_layout(n_params, optimizer, micro_batches, gpu_bytes, activation_bytes):
    """The notebook's solution: 16-bit weights, fp32 masters and states; one micro-batch's bf16
    gradient copies into fp32 exactly, a sum of several needs the fp32 main_grad."""
    per = 2 + 4 + 4 * STATES[optimizer] + (2 if micro_batches == 1 else 4)
    need = per * n_params
    return ("master" if micro_batches == 1 else "main_grad", need) \
        if need <= gpu_bytes - activation_bytes else (None, 0)


def _pick_with(grads, states=4, master=4, both=False, activations=True, optimizer=None,
               fallback=False):
    """A learner's pick with one thing wrong: `grads(k)` the layout by micro-batches."""
    def pick(n, opt, k, gpu, act):
        s = STATES[optimizer or opt]
        free = gpu - act if activations else gpu
        layout = grads(k)
        g = {"master": 2, "main_grad": 4 + 2 * both, "both_grads": 6}[layout]
        need = (2 + g + master + states * s) * n
        if need <= free:
            return layout, need
        if fallback:
            for lay, per in (("master", 8 + 4 * s), ("bf16", 4 + 2 * s)):
                if per * n <= free:
                    return lay, per * n
        return None, 0
    return pick


_BY_K = lambda k: "master" if k == 1 else "main_grad"           # noqa: E731


def test_pick_layout_reference_passes():
    for _ in range(10):
        check_bf16_layout(bf16_layout)
    check_bf16_layout(lambda *a: (lambda lay, b: (lay, torch.tensor(b).item()))(*bf16_layout(*a)))


@pytest.mark.parametrize("wrong, hint", [
    (_pick_with(lambda k: "main_grad"), "copied into fp32, is exact"),
    (_pick_with(lambda k: "master"), "sums them with bf16 rounding"),
    (_pick_with(lambda k: "master" if k == 1 else "both_grads"), "adds 2 bytes per parameter"),
    (_pick_with(_BY_K, fallback=True), "when no exact layout fits, say so"),
    (_pick_with(_BY_K, activations=False), "gpu_bytes - activation_bytes"),
    (_pick_with(_BY_K, optimizer="adam"), "count the optimizer you are given"),
    (_pick_with(_BY_K, states=2), "its states are fp32 too"),
    (_pick_with(_BY_K, master=0), "4 more bytes per parameter"),
    (_pick_with(_BY_K, both=True), r"4 bytes of gradient, not 2 \+ 4"),
    (lambda *a: bf16_layout(*a)[0], r"expected \(layout, model-state bytes\)"),
    (lambda *a: ("fp16", 0), "not one of"),
    (lambda *a: (bf16_layout(*a)[0], float(bf16_layout(*a)[1])), "should be an int"),
])
def test_pick_layout_wrong_answers_fail(wrong, hint):
    hits = 0
    for _ in range(5):
        with pytest.raises(CheckFailed) as failed:
            check_bf16_layout(wrong)
        hits += bool(__import__("re").search(hint, failed.value.hint + failed.value.summary))
    assert hits >= 4, (hint, failed.value.summary, failed.value.hint)    # 2 regimes can tie


def _adamw_three_states(n_params, optimizer, micro_batches, gpu_bytes, activation_bytes):
    """The independent review's wrong answer (issue 54; 13 of 46 runs passed while AdamW was
    drawn against Adam): AdamW counted with a third state for its weight decay."""
    states = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 3}[optimizer]
    need = (2 + 4 + 4 * states + (2 if micro_batches == 1 else 4)) * n_params
    return ("master" if micro_batches == 1 else "main_grad", need) \
        if need <= gpu_bytes - activation_bytes else (None, 0)


def _by_bytes_per_parameter(n, optimizer, k, gpu, act):
    """The review's honest variant: a table of bytes per parameter, no estimate."""
    per = (8 if k == 1 else 10) + 4 * STATES[optimizer]
    return ("master" if k == 1 else "main_grad", per * n) if per * n <= gpu - act else (None, 0)


def test_adamw_with_a_third_state_fails_every_run():
    for _ in range(20):
        with pytest.raises(CheckFailed, match="AdamW differs from Adam only"):
            check_bf16_layout(_adamw_three_states)
        check_bf16_layout(bf16_layout)
        check_bf16_layout(_by_bytes_per_parameter)


@pytest.mark.parametrize("few", [2, 4, 8])
def test_16_bit_gradients_for_a_few_micro_batches_fail_every_run(few):
    # 'master' while k <= 4 passed 4 of 6 runs when every k > 1 was drawn from 2..64 (the
    # learner's review), 10 of 20 before one case was pinned at k = 2
    wrong = _pick_with(lambda k: "master" if k <= few else "main_grad")
    for _ in range(20):
        with pytest.raises(CheckFailed, match="sums them with bf16 rounding"):
            check_bf16_layout(wrong)


def test_a_strict_fits_passes_every_run():
    def strict(n, optimizer, k, gpu, act):       # the learner's honest variant: need < free
        layout, need = bf16_layout(n, optimizer, k, gpu, act)
        return (layout, need) if need < gpu - act else (None, 0)
    for _ in range(20):
        check_bf16_layout(strict)


# ---------------------------------------------------------------- from which batch autocast saves

def autocast_saves_from(d_in, width, depth, d_out):
    per_example = 2 * depth * width - 2 * d_in
    fixed = 2 * ((depth - 1) * width * width + width * d_out)
    if per_example <= 0:
        return None
    return fixed // per_example + 1


def _from(fixed=lambda d, W, L, K: 2 * ((L - 1) * W * W + W * K),
          per=lambda d, W, L, K: 2 * L * W - 2 * d, strict=True, never=True):
    """The reference with one term changed: a known-wrong count."""
    def answer(d, W, L, K):
        f, p = fixed(d, W, L, K), per(d, W, L, K)
        if p <= 0 and never:
            return None
        return f // p + 1 if strict else -(-f // p)
    return answer


def _by_search(d_in, width, depth, d_out):
    """Correct, by walking the batch up with both counts written out (slow but right)."""
    def fp32(B):
        return 4 * depth * B * width + 4 * B * d_out + 4
    def amp(B):
        return (2 * B * d_in + 2 * ((depth - 1) * width**2 + width * d_out)
                + 2 * depth * B * width + 4 * B * d_out + 4)
    if 2 * depth * width <= 2 * d_in:
        return None
    B = 1
    while amp(B) >= fp32(B):
        B += 1
    return B


def test_autocast_saves_from_reference_passes():
    check_autocast_activation_bytes(autocast_saves_from)
    check_autocast_activation_bytes(_by_search)


def test_the_pinned_shapes_break_even_where_track_says():
    """The check's fixed shapes, measured: autocast keeps at least fp32's bytes one batch below
    the answer and fewer at it (or at no batch up to 8 where the answer is None)."""
    from companion.checks.ch05.autocast_bytes import _PINNED, _measure, _reference
    for d_in, W, L, K in _PINNED:
        b = _reference(d_in, W, L, K)
        assert b == autocast_saves_from(d_in, W, L, K)
        for B in ((b - 1, b) if b is not None else (1, 8)):
            saves = _measure(B, d_in, W, L, K, True) < _measure(B, d_in, W, L, K, False)
            assert saves == (b is not None and B == b), (d_in, W, L, K, B)


@pytest.mark.parametrize("wrong, hint", [
    (_from(fixed=lambda d, W, L, K: 0), "weight matrices are saved"),
    (_from(fixed=lambda d, W, L, K: 2 * (L * W * W - W * W + W * K + d * W)), "first Linear's"),
    (_from(per=lambda d, W, L, K: 2 * L * W), "copy of the input batch"),
    (_from(per=lambda d, W, L, K: 2 * L * W - 2 * d + 2 * K), "fp32 list"),
    (_from(per=lambda d, W, L, K: 2 * L * W - 2 * d - 2 * K), "16-bit logits are not saved"),
    (lambda d, W, L, K: None, "2 bytes, not 4"),
    (_from(per=lambda d, W, L, K: 4 * L * W - 2 * d), "count it once"),
    (_from(per=lambda d, W, L, K: 2 * (L + 1) * W - 2 * d), r"depth \+ 1 Linears"),
    (_from(fixed=lambda d, W, L, K: 2 * ((L - 1) * W * W + W * K + (L - 1) * W + K)), "bias"),
    (_from(strict=False), "strict"),
    (_from(fixed=lambda d, W, L, K: 2 * ((L - 1) * W * W + W * K) + 4), None),
    (_from(fixed=lambda d, W, L, K: 2 * ((L - 1) * W * W + W * K) - 4), None),
    (lambda d, W, L, K: 1 if 2 * L * W <= 2 * d else autocast_saves_from(d, W, L, K), "None"),
    (lambda d, W, L, K: 0 if 2 * L * W <= 2 * d else autocast_saves_from(d, W, L, K), "None"),
    (lambda d, W, L, K: 2 * ((L - 1) * W * W + W * K) // (2 * L * W - 2 * d) + 1, None),
    (lambda d, W, L, K: (lambda b: None if b is None else float(b))(
        autocast_saves_from(d, W, L, K)), "whole number"),
])
def test_autocast_saves_from_wrong_answers_fail_every_time(wrong, hint):
    for _ in range(3):
        with pytest.raises(CheckFailed, match=hint):
            check_autocast_activation_bytes(wrong)


# ---------------------------------------------------------------- FP8 with a scale

def to_e4m3(x, amax):
    amax = float(amax)
    scale = 448.0 / amax if amax > 0 and math.isfinite(amax) else 1.0
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() > 464).sum())


def test_to_e4m3_reference_passes():
    from companion import scaling
    check_to_e4m3(to_e4m3)

    def from_the_companion(x, amax):
        scale = scaling.amax_scale(amax, "e4m3")
        codes, overflows = scaling.quantize(x, scale, "e4m3")
        return codes, scale, overflows
    check_to_e4m3(from_the_companion)


def test_the_overflow_limit_is_where_torchs_cast_stops_rounding_to_448():
    below, above = torch.tensor([463.99]), torch.tensor([464.01])
    assert below.to(torch.float8_e4m3fn).float().item() == 448.0
    assert above.to(torch.float8_e4m3fn).float().item() == 448.0           # saturated, silently
    assert to_e4m3(below, 448.0)[2] == 0 and to_e4m3(above, 448.0)[2] == 1


def _inverted(x, amax):
    codes, scale, overflows = to_e4m3(x, amax)
    return codes, 1.0 / scale, overflows


def _counted_after_the_cast(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int((codes.float().abs() >= 464).sum())


def _beyond_448(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int(((x.float() * scale).abs() > 448).sum())


def _own_amax(x, amax):
    return to_e4m3(x, x.float().abs().max())


def _no_zero_case(x, amax):
    scale = 448.0 / float(amax) if float(amax) != 0 else math.inf
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() > 464).sum())


def _positive_only(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int(((x.float() * scale) > 464).sum())


def _bf16_product(x, amax):
    _, scale, overflows = to_e4m3(x, amax)
    return (x * scale).to(torch.float8_e4m3fn), scale, overflows     # in x's dtype: rounds twice


@pytest.mark.parametrize("wrong, hint", [
    (_inverted, "not amax / 448"),
    (_counted_after_the_cast, "count before the cast"),
    (_beyond_448, "still rounds to 448"),
    (_own_amax, "the amax you are given"),
    (_no_zero_case, "nothing to scale by"),
    (_positive_only, "about magnitude"),
    (_bf16_product, "multiply in float32"),
    (lambda x, amax: (x.to(torch.float8_e4m3fn), 1.0, 0), "scale"),
])
def test_to_e4m3_wrong_answers_fail(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        check_to_e4m3(wrong)


def _amax_unconverted(x, amax):
    """bench_mutants' survivor (issue 54): `float(amax)` left out, so a bf16 amax makes a bf16
    scale."""
    scale = 448.0 / amax if amax > 0 and math.isfinite(amax) else 1.0
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() > 464).sum())


def _scales_above_one_only(x, amax):
    """bench_mutants' survivor (issue 54): `amax > 1` for `amax > 0`: a gradient's amax gets a
    scale of 1."""
    amax = float(amax)
    scale = 448.0 / amax if amax > 1 and math.isfinite(amax) else 1.0
    scaled = x.float() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() > 464).sum())


@pytest.mark.parametrize("wrong, hint", [
    (_amax_unconverted, "rounded to its precision"),
    (_scales_above_one_only, "amax below 1"),
])
def test_to_e4m3_fails_a_scale_from_a_bf16_or_small_amax_every_time(wrong, hint):
    for _ in range(20):
        with pytest.raises(CheckFailed, match=hint):
            check_to_e4m3(wrong)
        check_to_e4m3(to_e4m3)


def _counted_from_464_on(x, amax):
    codes, scale, _ = to_e4m3(x, amax)
    return codes, scale, int(((x.float() * scale).abs() >= 464).sum())


def _float64_product(x, amax):
    """Honest (the statement names no dtype for the product): x * scale in float64, then cast;
    it rounds some bf16 products to the other side of an e4m3 midpoint than float32's does."""
    amax = float(amax)
    scale = 448.0 / amax if amax > 0 and math.isfinite(amax) else 1.0
    scaled = x.double() * scale
    return scaled.to(torch.float8_e4m3fn), scale, int((scaled.abs() > 464).sum())


def test_to_e4m3_fails_counting_from_464_on_every_time():
    """`>= 464` for `> 464` differs only at 464 itself, the tie that round-to-nearest-even takes to
    448; the exercise asks where "could not represent" begins, so the tie is graded (the review
    passed `>=` in every run while the check's values beside the limit were 463.9 and 464.1)."""
    assert torch.tensor([464.0, -464.0]).to(torch.float8_e4m3fn).float().abs().tolist() == \
        [448.0, 448.0]
    for _ in range(20):
        with pytest.raises(CheckFailed, match="exactly 464"):
            check_to_e4m3(_counted_from_464_on)
        check_to_e4m3(to_e4m3)


def test_to_e4m3_a_float64_product_passes_every_time():
    """The review's false failure (11 of 11 runs): the bf16 case with amax 13, where the float64
    product and float32's cast some values to neighbouring codes; both are accepted."""
    x = torch.linspace(-13.0, 13.0, 4001).bfloat16()
    assert not torch.equal(to_e4m3(x, torch.tensor(13.0))[0].float(),
                           _float64_product(x, torch.tensor(13.0))[0].float()), "no midpoint hit"
    for _ in range(20):
        check_to_e4m3(_float64_product)
        check_to_e4m3(to_e4m3)


# ---------------------------------------------------------------- current or delayed scaling

def choose_scaling(trace, history, *, with_own=False, own_first=False, by="both", limit=464.0,
                   count_after_cast=False, current_from=0, worse_than=float.__gt__, factor=2.0,
                   longer=0, mean_error=False):
    """The notebook's solution; the keywords make the known-wrong ones."""
    amaxes = [float(x.abs().max()) for x in trace]
    overflows, worse = 0, False
    for t, x in enumerate(trace):
        window = amaxes[max(0, t - history - longer + with_own):t + with_own]
        errors = []
        for amax in (amaxes[t + current_from],
                     max(window) if window else amaxes[t] if own_first else None):
            scale = 448.0 / amax if amax else 1.0
            scaled = x.float() * scale
            codes = scaled.to(torch.float8_e4m3fn)
            back = codes.float() / scale
            errors.append(float(((back - x).abs() / x.abs().clamp_min(1e-30)).mean()
                                if mean_error else (back - x).norm() / x.norm()))
            over = int(((codes.float() if count_after_cast else scaled).abs() > limit).sum())
        overflows += over
        worse |= worse_than(errors[1], factor * errors[0])
    bad = {"both": overflows > 0 or worse, "overflows": overflows > 0, "error": worse}[by]
    return ("current" if bad else "delayed"), overflows


def test_choose_scaling_reference_passes():
    from companion.checks.ch05.scaling_choice import _choose, _trace_errors
    for _ in range(10):
        check_choose_scaling(choose_scaling)
    check_choose_scaling(lambda trace, history: _choose(_trace_errors(trace, history)))


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, h: choose_scaling(t, h, with_own=True), "from the steps before this one only"),
    (lambda t, h: choose_scaling(t, h, own_first=True), "with no history yet"),
    (lambda t, h: choose_scaling(t, h, by="overflows"), "decide on both"),
    (lambda t, h: choose_scaling(t, h, by="error"), "decide on both"),
    (lambda t, h: choose_scaling(t, h, limit=448.0), "round-to-nearest cannot bring"),
    (lambda t, h: choose_scaling(t, h, count_after_cast=True), "before the cast"),
    (lambda t, h: choose_scaling(t, h)[0], r"expected \(choice, overflows\)"),
    (lambda t, h: ("fp8", 0), '"current" or "delayed"'),
    (lambda t, h: (choose_scaling(t, h)[0], float(choose_scaling(t, h)[1])), "should be an int"),
])
def test_choose_scaling_wrong_answers_fail(wrong, hint):
    for _ in range(3):
        with pytest.raises(CheckFailed) as failed:
            check_choose_scaling(wrong)
        assert __import__("re").search(hint, failed.value.hint + failed.value.summary), \
            (failed.value.summary, failed.value.hint)


@pytest.mark.parametrize("wrong, hint", [
    # bench_mutants' survivors (issue 54)
    (dict(current_from=-1), "falls 14,000x"),           # current scaling from the step before's
    (dict(factor=3.0), "falls 14,000x"),                # 2.4x current's error let through
    (dict(worse_than=float.__ge__), "both recipes' errors are 0"),   # 0 is within 2 x 0
])
def test_choose_scaling_fails_the_fixed_traces_mistakes_every_time(wrong, hint):
    for _ in range(20):
        with pytest.raises(CheckFailed, match=hint):
            check_choose_scaling(lambda t, h: choose_scaling(t, h, **wrong))
        check_choose_scaling(choose_scaling)


@pytest.mark.parametrize("wrong, hint", [
    # the independent review's (issue 54): a window of history + 1 steps passed 31 of 36 runs, a
    # mean of each value's relative error for the norm ratio 16 of 16
    (dict(longer=1), "count the steps your slice holds"),
    (dict(mean_error=True), "An average of each value's own relative error"),
])
def test_choose_scaling_fails_the_reviews_mistakes_every_time(wrong, hint):
    for _ in range(20):
        with pytest.raises(CheckFailed, match=hint):
            check_choose_scaling(lambda t, h: choose_scaling(t, h, **wrong))
        check_choose_scaling(choose_scaling)


# ---------------------------------------------------------------- garbage and hangs

CHECKS = [check_replay_loss_scale, check_unscale_grads, check_bf16_layout, check_choose_scaling,
          check_autocast_activation_bytes, check_to_e4m3]


def _hangs(*args):
    while True:
        pass


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("garbage", [None, "answer", 1.0, lambda *a: None, lambda *a: 1 / 0,
                                     lambda *a: torch.tensor(math.nan),
                                     lambda *a: torch.ones(3, dtype=torch.int64)])
def test_garbage_fails_cleanly(check, garbage):
    with pytest.raises(CheckFailed):
        check(garbage)


@pytest.mark.parametrize("check", CHECKS)
def test_a_hang_fails_within_the_time_limit(check):
    with pytest.raises(CheckFailed, match="did not finish"):
        check(_hangs, timeout=1.0)
