"""companion.gd against autograd and torch.optim."""
import pytest
import torch

from companion import gd
from companion.models import make_regression


@pytest.fixture
def problem():
    X, y, _, _ = make_regression(67, 5, seed=3)
    g = torch.Generator().manual_seed(4)
    return X, y, torch.randn(5, generator=g), torch.randn((), generator=g)


def test_mse_loss_matches_torch(problem):
    X, y, w, b = problem
    expected = torch.nn.functional.mse_loss(X @ w + b, y)
    torch.testing.assert_close(gd.mse_loss(X, y, w, b), expected)


def test_hand_gradient_matches_autograd(problem):
    X, y, w, b = problem
    dw, db = gd.mse_gradient(X, y, w, b)
    w_ = w.clone().requires_grad_()
    b_ = b.clone().requires_grad_()
    torch.nn.functional.mse_loss(X @ w_ + b_, y).backward()
    torch.testing.assert_close(dw, w_.grad)
    torch.testing.assert_close(db, b_.grad)
    torch.testing.assert_close(gd.autograd_gradient(X, y, w, b), (w_.grad, b_.grad))


def test_sgd_step_matches_torch_optim(problem):
    X, y, w, b = problem
    mine = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), lr=0.07)
    torch.testing.assert_close(mine, gd.torch_sgd_step(X, y, w, b, lr=0.07))


def test_sgd_step_moves_parameters_not_gradients(problem):
    _, _, w, b = problem
    dw, db = torch.ones_like(w), torch.ones(())
    w1, b1 = gd.sgd_step(w, b, dw, db, lr=0.5)
    torch.testing.assert_close(w1, w - 0.5)
    assert torch.equal(dw, torch.ones_like(w))


def test_sgd_step_takes_the_learning_rate_as_the_exercise_passes_it(problem):
    """Chapter 01's exercise has the signature sgd_step(w, b, dw, db, lr): the reference agrees."""
    _, _, w, b = problem
    dw, db = torch.ones_like(w), torch.ones(())
    torch.testing.assert_close(gd.sgd_step(w, b, dw, db, 0.5), gd.sgd_step(w, b, dw, db, lr=0.5))


def test_batches_cover_every_example_once():
    parts = gd.batches(10, 4)
    assert [len(p) for p in parts] == [4, 4, 2]
    shuffled = gd.batches(10, 3, generator=torch.Generator().manual_seed(0))
    assert sorted(torch.cat(shuffled).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="at least 1"):
        gd.batches(10, 0)


def test_train_epoch_chains_batches(problem):
    X, y, w, b = problem
    w1, b1, losses = gd.train_epoch(X, y, w, b, lr=0.1, batch_size=20)
    assert len(losses) == 4
    ws, bs = w, b
    for start in range(0, 67, 20):
        ws, bs = gd.sgd_step(ws, bs, *gd.mse_gradient(X[start:start + 20], y[start:start + 20], ws, bs),
                             lr=0.1)
    torch.testing.assert_close((w1, b1), (ws, bs))


def test_full_batch_epoch_is_one_torch_sgd_step(problem):
    X, y, w, b = problem
    w1, b1, _ = gd.train_epoch(X, y, w, b, lr=0.1, batch_size=len(y))
    torch.testing.assert_close((w1, b1), gd.torch_sgd_step(X, y, w, b, lr=0.1))


def test_training_converges_and_large_lr_diverges():
    X, y, w_true, b_true = make_regression(256, 4, noise=0.05, seed=1)
    run = gd.train(X, y, lr=0.05, batch_size=16, epochs=20)
    assert not run["diverged"]
    torch.testing.assert_close(run["w"], w_true, atol=0.05, rtol=0)
    assert gd.train(X, y, lr=3.0, batch_size=256, epochs=5)["diverged"]


def test_explore_reports_updates_and_bytes():
    X, y, _, _ = make_regression(100, 3)
    view = gd.explore(X, y, lr=0.05, batch_size=32, epochs=2)
    assert view["updates"] == 8 and view["examples_seen"][-1] == 200
    assert view["batch_bytes"] == 32 * 4 * 4
    assert "8 updates" in view["summary"]


def test_gd_explorer_widget_builds():
    from companion.widgets import gd_explorer
    X, y, _, _ = make_regression(64, 3)
    box = gd_explorer(X, y, epochs=2)
    lr_slider, batch_slider = box.children[0].children
    before = box.children[1].value
    batch_slider.value = 64
    assert box.children[1].value != before and "batch=64" in box.children[1].value


def test_steps_to_loss_counts_updates_and_gives_up_on_divergence(problem):
    X, y, _, _ = problem
    w, b = torch.zeros(X.shape[1]), torch.zeros(())
    target, steps = 0.5, 0
    while float(gd.mse_loss(X, y, w, b)) > target:              # full batch by hand
        w, b = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), 0.1)
        steps += 1
    assert gd.steps_to_loss(X, y, lr=0.1, batch_size=len(y), target=target) == steps
    assert gd.steps_to_loss(X, y, lr=50.0, batch_size=len(y), target=target) is None
    assert gd.steps_to_loss(X, y, lr=1e-6, batch_size=8, target=target, max_steps=5) is None


def test_noise_scale_is_trace_of_per_example_covariance_over_squared_gradient(problem):
    X, y, w, b = problem
    rows = []
    for i in range(len(y)):                                   # each example's gradient, by autograd
        dw, db = gd.autograd_gradient(X[i:i + 1], y[i:i + 1], w, b)
        rows.append(torch.cat([dw, db.reshape(1)]))
    per_example = torch.stack(rows)
    G = per_example.mean(0)
    expected = per_example.var(0).sum() / (G @ G)
    assert gd.noise_scale(X, y, w, b) == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.parametrize("s_min, e_min", [(2.0, 80.0), (7.5, 3000.0), (1.0, 1.0)])
def test_fit_pareto_front_recovers_known_minima(s_min, e_min):
    B = [1, 3, 8, 20, 64, 200, 1024]
    S = [s_min + e_min / b for b in B]                           # on the front exactly
    assert gd.fit_pareto_front(B, S) == pytest.approx((s_min, e_min), rel=1e-9)
    E = [b * s for b, s in zip(B, S)]                            # McCandlish et al.'s front
    assert all(abs((s / s_min - 1) * (e / e_min - 1) - 1) < 1e-9 for s, e in zip(S, E))
    g = torch.Generator().manual_seed(0)                         # 3 % noise: still close
    noisy = [s * (1 + 0.03 * float(torch.randn((), generator=g))) for s in S]
    fitted = gd.fit_pareto_front(B, noisy)
    assert fitted[0] == pytest.approx(s_min, rel=0.1) and fitted[1] == pytest.approx(e_min, rel=0.1)


@pytest.mark.parametrize("m, d, shift", [(67, 5, 0.0), (31, 3, 2.0), (200, 1, -1.5)])
def test_max_stable_lr_is_the_edge_of_divergence(m, d, shift):
    X, y, _, _ = make_regression(m, d, seed=m)
    X = X + shift                                                 # off-centre: the bias matters
    lr = gd.max_stable_lr(X)
    Xt = torch.cat([X, torch.ones(m, 1)], 1).double()
    H = torch.func.hessian(lambda p: ((Xt @ p - y.double()) ** 2).mean())(torch.zeros(d + 1,
                                                                                    dtype=torch.float64))
    assert lr == pytest.approx(2 / float(torch.linalg.eigvalsh(H)[-1]), rel=1e-9)

    def final_loss(rate):
        w, b = torch.zeros(d, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for _ in range(400):
            w, b = gd.sgd_step(w, b, *gd.mse_gradient(X.double(), y.double(), w, b), rate)
        return float(gd.mse_loss(X.double(), y.double(), w, b))
    assert final_loss(0.97 * lr) < float(gd.mse_loss(X, y, torch.zeros(d), torch.zeros(())))
    assert not final_loss(1.03 * lr) < 1e6


def _hadamard_features(m: int, d: int) -> torch.Tensor:
    """Columns of a Sylvester-Hadamard matrix but the first (all ones): zero mean, orthogonal to
    each other and to the bias column, so the MSE Hessian is 2·I."""
    H = torch.ones(1, 1)
    while H.shape[0] < m:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H[:, 1:d + 1]


def test_mse_hessian_matches_torch_func_hessian(problem):
    X, y, _, _ = problem
    Xt = torch.cat([X, torch.ones(len(y), 1)], 1).double()
    expected = torch.func.hessian(lambda p: ((Xt @ p - y.double()) ** 2).mean())(
        torch.zeros(X.shape[1] + 1, dtype=torch.float64))
    torch.testing.assert_close(gd.mse_hessian(X), expected)


def test_b_noise_weighs_the_noise_by_the_hessian(problem):
    X, y, w, b = problem
    X = X * torch.tensor([1.0, 3.0, 0.3, 1.0, 2.0])                  # anisotropic: H is not c·I
    r = X @ w + b - y
    per_example = torch.cat([2 * X * r[:, None], 2 * r[:, None]], 1).double()
    G, sigma = per_example.mean(0), per_example.T.cov()
    H = torch.func.hessian(lambda p: ((torch.cat([X, torch.ones(len(y), 1)], 1).double() @ p
                                       - y.double()) ** 2).mean())(torch.zeros(6, dtype=torch.float64))
    expected = float(torch.trace(H @ sigma) / (G @ H @ G))
    assert gd.noise_scale(X, y, w, b, hessian=True) == pytest.approx(expected, rel=1e-4)
    assert gd.noise_scale(X, y, w, b, hessian=True) != pytest.approx(gd.noise_scale(X, y, w, b),
                                                                     rel=0.05)


def test_b_noise_equals_b_simple_when_the_hessian_is_a_multiple_of_the_identity():
    X = _hadamard_features(64, 5)
    torch.testing.assert_close(gd.mse_hessian(X), 2 * torch.eye(6, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    y = X @ torch.randn(5, generator=g) + torch.randn(64, generator=g)
    w, b = torch.zeros(5), torch.zeros(())
    assert gd.noise_scale(X, y, w, b, hessian=True) == pytest.approx(gd.noise_scale(X, y, w, b),
                                                                     rel=1e-5)


def test_least_squares_loss_is_the_floor_of_the_mse(problem):
    X, y, _, _ = problem
    X, y = X.double(), y.double()
    w, b = torch.zeros(X.shape[1], dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for _ in range(3000):                                           # full-batch descent to the bottom
        w, b = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), 0.5 * gd.max_stable_lr(X))
    assert gd.least_squares_loss(X, y) == pytest.approx(float(gd.mse_loss(X, y, w, b)), rel=1e-9)
    assert gd.least_squares_loss(X, y) < float(gd.mse_loss(X, y, w + 0.01, b))


def test_excess_loss_with_sgd_takes_the_hand_written_steps(problem):
    X, y, _, _ = problem
    run = gd.train(X, y, lr=0.05, batch_size=8, epochs=2, seed=3)
    expected = float(gd.mse_loss(X.double(), y.double(), run["w"].double(), run["b"].double()))
    got = gd.excess_loss(X, y, lr=0.05, batch_size=8, epochs=2, seed=3)
    assert got == pytest.approx(expected - gd.least_squares_loss(X, y), rel=1e-4)
    assert gd.excess_loss(X, y, lr=50.0, batch_size=len(y), epochs=30) == float("inf")


def test_excess_loss_with_adam_is_torch_adam_on_autograd(problem):
    X, y, _, _ = problem
    g = torch.Generator().manual_seed(5)
    w = torch.zeros(X.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.03)
    for _ in range(2):
        for idx in torch.randperm(len(y), generator=g).split(4):  # the shuffles gd.batches makes
            opt.zero_grad()
            torch.nn.functional.mse_loss(X[idx] @ w + b, y[idx]).backward()
            opt.step()
    expected = float(gd.mse_loss(X.double(), y.double(), w.detach().double(), b.detach().double()))
    got = gd.excess_loss(X, y, lr=0.03, batch_size=4, epochs=2, seed=5, optimizer=torch.optim.Adam)
    assert got == pytest.approx(expected - gd.least_squares_loss(X, y), rel=1e-4)


def test_best_lr_picks_the_lowest_mean_and_refines_between_its_neighbours(problem):
    X, y, _, _ = problem
    lrs = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]
    lr, loss = gd.best_lr(X, y, batch_size=4, lrs=lrs, seeds=[0, 1])
    scores = [sum(gd.excess_loss(X, y, lr=r, batch_size=4, seed=s) for s in (0, 1)) / 2 for r in lrs]
    i = scores.index(min(scores))
    assert loss == pytest.approx(scores[i], rel=1e-12)
    assert lrs[i - 1] <= lr <= lrs[i + 1]
    assert gd.max_stable_lr(X) > lr                                 # a diverging rate never wins


def test_best_lr_refuses_an_optimum_at_the_end_of_the_grid(problem):
    X, y, _, _ = problem
    with pytest.raises(ValueError, match="widen the grid"):
        gd.best_lr(X, y, batch_size=8, lrs=[1e-4, 2e-4, 4e-4], seeds=[0])


@pytest.mark.parametrize("batch_size", [0, 2.5, True, 10**6])
def test_best_lr_refuses_a_batch_size_it_cannot_use(problem, batch_size):
    X, y, _, _ = problem
    with pytest.raises(ValueError, match="batch_size is a whole number"):
        gd.best_lr(X, y, batch_size=batch_size, lrs=[0.01, 0.02, 0.04], seeds=[0])


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.0])
def test_scaling_exponent_recovers_a_power_law(alpha):
    B = [1, 2, 4, 8, 32]
    assert gd.scaling_exponent(B, [0.01 * b ** alpha for b in B]) == pytest.approx(alpha, abs=1e-9)
    with pytest.raises(ValueError, match="two different batch sizes"):
        gd.scaling_exponent([4, 4], [0.1, 0.2])


def test_noiseless_lr_is_the_best_full_batch_step(problem):
    X, y, w, b = problem
    X, y, w, b = X.double(), y.double(), w.double(), b.double()
    eta = gd.noiseless_lr(X, y, w, b)

    def after_step(rate):
        return float(gd.mse_loss(X, y, *gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), rate)))
    assert after_step(eta) < min(after_step(0.99 * eta), after_step(1.01 * eta))
    w1, b1 = gd.sgd_step(w, b, *gd.mse_gradient(X, y, w, b), eta)   # exact line search: the new
    G0 = torch.cat([t.reshape(-1) for t in gd.mse_gradient(X, y, w, b)])   # gradient is orthogonal
    G1 = torch.cat([t.reshape(-1) for t in gd.mse_gradient(X, y, w1, b1)])  # to the old one
    assert float(G0 @ G1) == pytest.approx(0.0, abs=1e-9 * float(G0 @ G0))
    lam = torch.linalg.eigvalsh(gd.mse_hessian(X))
    assert 1 / float(lam[-1]) <= eta <= 1 / float(lam[0])


def test_noiseless_lr_refuses_a_zero_gradient():
    X = _hadamard_features(8, 2)
    with pytest.raises(ValueError, match="gradient is zero"):
        gd.noiseless_lr(X, X @ torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.zeros(()))


def test_best_lr_takes_the_seeds_from_a_generator(problem):
    X, y, _, _ = problem
    lrs = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]
    from_list = gd.best_lr(X, y, batch_size=4, lrs=lrs, seeds=[0, 1])
    same = pytest.approx(from_list, rel=1e-9)                     # threads may round differently
    assert gd.best_lr(X, y, batch_size=4, lrs=lrs, seeds=(s for s in (0, 1))) == same
    assert gd.best_lr(X, y, batch_size=4, lrs=iter(lrs), seeds=[0, 1]) == same
    with pytest.raises(ValueError, match="at least one shuffle seed"):
        gd.best_lr(X, y, batch_size=4, lrs=lrs, seeds=[])


@pytest.mark.parametrize("lrs, match", [([0.01, 0.02, 0.02, 0.04], "repeats"),
                                        ([0.0, 0.01, 0.02], "above zero"),
                                        ([-0.01, 0.01, 0.02], "above zero"),
                                        ([float("nan"), 0.01, 0.02], "above zero"),
                                        ([0.01, 0.02, float("inf")], "above zero")])
def test_best_lr_refuses_a_bad_grid(problem, lrs, match):
    X, y, _, _ = problem
    with pytest.raises(ValueError, match=match):
        gd.best_lr(X, y, batch_size=4, lrs=lrs, seeds=[0])


@pytest.mark.parametrize("batch_sizes, lrs, match", [([1, 2, 4], [0.1, -0.2, 0.4], "above zero"),
                                                     ([1, 2, 4], [0.1, float("nan"), 0.4], "above zero"),
                                                     ([0, 2, 4], [0.1, 0.2, 0.4], "above zero"),
                                                     ([1, 2, float("inf")], [0.1, 0.2, 0.4], "above zero"),
                                                     ([1, 2, 4], [0.1, 0.2], "one rate per batch")])
def test_scaling_exponent_refuses_bad_input(batch_sizes, lrs, match):
    with pytest.raises(ValueError, match=match):
        gd.scaling_exponent(batch_sizes, lrs)


def test_least_squares_loss_refuses_nan_and_empty_data(problem):
    X, y, _, _ = problem
    y_nan = y.clone()
    y_nan[3] = float("nan")
    with pytest.raises(ValueError, match="y has NaN"):
        gd.least_squares_loss(X, y_nan)
    X_inf = X.clone()
    X_inf[0, 0] = float("inf")
    with pytest.raises(ValueError, match="X has NaN or infinite"):
        gd.least_squares_loss(X_inf, y)
    with pytest.raises(ValueError, match="no rows"):
        gd.least_squares_loss(X[:0], y[:0])


def test_mse_hessian_refuses_an_empty_batch(problem):
    X, _, _, _ = problem
    with pytest.raises(ValueError, match="no rows"):
        gd.mse_hessian(X[:0])
    with pytest.raises(ValueError, match="no rows"):
        gd.max_stable_lr(X[:0])


@pytest.mark.parametrize("hessian", [False, True])
def test_noise_scale_needs_two_examples(problem, hessian):
    X, y, w, b = problem
    with pytest.raises(ValueError, match="at least 2 examples"):
        gd.noise_scale(X[:1], y[:1], w, b, hessian=hessian)
    assert gd.noise_scale(X[:2], y[:2], w, b, hessian=hessian) > 0
