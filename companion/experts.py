"""Expert parallelism: a mixture of experts whose E experts live E/W to a rank, tokens routed to
them by all-to-all, equal to the single-process layer.

A mixture-of-experts layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2020, arXiv:2006.16668;
Switch Transformer, Fedus et al. 2021, arXiv:2101.03961) replaces one MLP with E of them and a
router: a Linear to E logits, a softmax, and each token sent to its top-k experts (k = 1 Switch,
k = 2 GShard), its output the router-weighted sum of theirs. Parameters grow E times, compute per
token stays k MLPs. The E experts' weights do not fit one GPU, so expert parallelism puts E/W of
them on each of W ranks; each rank keeps its own tokens (data parallel) and a copy of the router:

1. route: logits (n, E) -> top-k experts and weights per token; with a capacity factor c each
   expert takes at most C = ceil(c·k·n/E) of a rank's n tokens, the rest dropped (GShard's order:
   every first choice before any second choice, then token order);
2. all-to-all of the counts: rank s tells rank r how many tokens it sends to each of r's experts
   ((W-1)·E/W int64 sent per rank), so the receive buffers can be sized;
3. all-to-all of the tokens (dispatch): variable splits, the rows for rank r's experts to rank r;
4. every local expert runs on the rows it received from all ranks;
5. all-to-all back (combine), and each token sums its experts' outputs times its router weights.

Backward runs the exchanges reversed (the combine's gradient goes back as the dispatch went, and
the dispatch's as the combine went): the same token bytes again. An expert's gradient is complete
on its owner, which the backward all-to-all brings every rank's token gradients to; the replicated
router's is summed over ranks as data parallelism does (`all_reduce_router_grads`). These are the
gradients of the sum of the ranks' losses; a mean over ranks divides them all by W.

The load-balancing loss (Switch, eq. 4) is E·Σ_i f_i·P_i: f_i the fraction of tokens whose first
choice is expert i (before drops), P_i the mean router probability of i; 1 when routing is uniform.
Imbalance costs twice: the busiest expert sets the step's time and, with a capacity, the drops
(`load_imbalance`: max over mean, per expert and per rank).

Example (inside each rank started by `companion.launch.run`, every rank building the same `moe`):
    >>> ep = ExpertParallelMoE(moe, rank, world)        # E/W experts, the router copied
    >>> stats = EPStats()
    >>> y = ep(x_local, stats=stats)                    # (n, d) -> (n, d)
    >>> (y * dy).sum().backward(); all_reduce_router_grads(ep)
    >>> stats.exchanges                                 # bytes sent, per all-to-all

Simplified vs Megatron-LM (MoELayer, token dispatchers), DeepSpeed-MoE and torch: each all-to-all
is written out as W - 1 paired send/recv steps so that every byte is counted as it is sent (torch's
`dist.all_to_all_single` with split sizes does it in one call, on gloo too, and gives the same rows); no tensor-parallel experts or expert-data-parallel groups, no shared experts,
no grouped GEMM (one MLP call per expert), no token permutation kernels, no router jitter, z-loss
or expert-choice routing; capacity is per rank's tokens (GShard's groups), never padded to C;
dropped tokens get zero from the layer (a residual connection outside it carries them).
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from companion.collectives import Traffic

__all__ = ["Routing", "route", "MoE", "EPStats", "all_to_all_variable", "ExpertParallelMoE",
           "all_reduce_router_grads", "expert_owner", "ep_bytes_per_rank", "expert_weight_bytes",
           "expert_activation_bytes", "load_imbalance"]


# ---------------------------------------------------------------- routing, shared by both layers

@dataclasses.dataclass
class Routing:
    """One routing of N tokens: expert and weight per (token, choice), and what it cost."""

    probs: torch.Tensor         # (N, E) router softmax
    expert: torch.Tensor        # (N, k) chosen experts, best first
    weight: torch.Tensor        # (N, k) their combine weights (differentiable)
    kept: torch.Tensor          # (N, k) bool: within the expert's capacity
    aux_loss: torch.Tensor      # Switch's E·Σ f_i·P_i, the mean over groups
    routed: torch.Tensor        # (E,) assignments per expert, before capacity
    dropped: int                # assignments over capacity


def route(logits: torch.Tensor, top_k: int, *, capacity_factor: float | None = None,
          groups: int = 1) -> Routing:
    """Top-k routing of (N, E) logits; capacity and the aux loss per group of N/groups tokens.

    Weights: the top-k probabilities, renormalised to sum to 1 when k > 1 (GShard). Capacity per
    expert per group: C = ceil(capacity_factor·k·n/E); an assignment keeps its place if fewer than
    C assignments to that expert precede it, first choices before second ones, then token order.
    """
    _check_options(top_k, logits.shape[-1], capacity_factor)
    if logits.ndim != 2 or groups < 1 or logits.shape[0] % groups:
        raise ValueError(f"logits must be (N, E) with N divisible by groups={groups}, got "
                         f"{tuple(logits.shape)}")
    N, E = logits.shape
    n = N // groups
    probs = logits.softmax(dim=-1)                                # (N, E)
    top, expert = probs.topk(top_k, dim=-1)                       # (N, k) each
    weight = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    onehot = F.one_hot(expert, E)                                 # (N, k, E) int64
    kept = torch.ones_like(expert, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * top_k * n / E)
        order = onehot.view(groups, n, top_k, E).transpose(1, 2).reshape(groups, top_k * n, E)
        before = (order.cumsum(dim=1) - order)                    # earlier claims on each expert
        before = before.view(groups, top_k, n, E).transpose(1, 2).reshape(N, top_k, E)
        kept = (before * onehot).sum(dim=-1) < capacity           # (N, k)
    f = onehot[:, 0].view(groups, n, E).to(probs.dtype).mean(dim=1)   # (G, E) first choices
    P = probs.view(groups, n, E).mean(dim=1)                       # (G, E) mean probability
    aux = E * (f * P).sum(dim=-1).mean()
    return Routing(probs, expert, weight, kept, aux, onehot.sum(dim=(0, 1)),
                   int((~kept).sum()))


def _check_options(top_k: int, num_experts: int, capacity_factor: float | None) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), "
                         f"got {top_k}: a token cannot choose more experts than there are")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive (1.0: exactly the balanced share) "
                         f"or None (no capacity), got {capacity_factor}")


def _mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class MoE(nn.Module):
    """The single-process reference: a router and E expert MLPs (width -> hidden -> width).

    `forward(x, groups=G)` takes (N, width) tokens, N divisible by G, and applies capacity and the
    aux loss per group of N/G tokens: G = W gives what W expert-parallel ranks compute on their
    own N/W tokens each. The routing of the last call (aux loss, drops) is `self.routing`."""

    def __init__(self, width: int, hidden: int, num_experts: int, *, top_k: int = 1,
                 capacity_factor: float | None = None):
        super().__init__()
        _check_options(top_k, num_experts, capacity_factor)
        self.width, self.top_k, self.capacity_factor = width, top_k, capacity_factor
        self.router = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(_mlp(width, hidden) for _ in range(num_experts))
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor, *, groups: int = 1) -> torch.Tensor:
        _check_tokens(x, self.router.weight, groups)
        self.routing = r = route(self.router(x), self.top_k,
                                 capacity_factor=self.capacity_factor, groups=groups)
        out = torch.zeros_like(x)                                  # (N, d)
        for e, expert in enumerate(self.experts):
            token, choice = torch.nonzero((r.expert == e) & r.kept, as_tuple=True)
            y = expert(x[token]) * r.weight[token, choice, None]   # (tokens of e, d)
            out = out.index_add(0, token, y)
        return out


def _check_tokens(x, weight: torch.Tensor, groups: int = 1) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"tokens must be a (N, {weight.shape[1]}) tensor (flatten (B, T, d) "
                         f"with x.reshape(-1, d)), got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"tokens are {x.dtype} but the layer's weights are {weight.dtype}: "
                         f"convert one (moe.to({x.dtype}) or x.to({weight.dtype}))")
    if groups < 1 or x.shape[0] % groups:
        raise ValueError(f"{x.shape[0]} tokens do not split into {groups} equal groups")


# ---------------------------------------------------------------- all-to-all, variable splits

@dataclasses.dataclass
class EPStats(Traffic):
    """One rank's forward: bytes sent per all-to-all (`exchanges`), its routing, the tokens its
    experts processed and the activation bytes they saved; `backward` counts the backward's."""

    exchanges: dict = dataclasses.field(default_factory=dict)
    routed: torch.Tensor | None = None        # (E,) this rank's assignments per expert
    kept: torch.Tensor | None = None          # (E,) those within capacity (sent)
    dropped: int = 0
    received_tokens: int = 0
    activation_bytes: int = 0
    backward: "EPStats | None" = None


def _peer(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_to_all_variable(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                        group=None, *, stats: Traffic | None = None,
                        name: str = "all_to_all") -> torch.Tensor:
    """Rows x[sum(send_sizes[:j]) : sum(send_sizes[:j+1])] go to rank j; returns the rows every
    rank sent here, in rank order (recv_sizes[j] from rank j). W - 1 steps, step s paired: to
    r + s, from r - s; empty messages are not sent. Bytes sent: rows to other ranks x row bytes."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pieces = list(x.split(send_sizes))
    arrived = [pieces[rank] if src == rank else x.new_empty((n, *x.shape[1:]))
               for src, n in enumerate(recv_sizes)]
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        ops = []
        if send_sizes[dst]:
            ops.append(dist.P2POp(dist.isend, pieces[dst].contiguous(), _peer(group, dst),
                                  group=group))
        if recv_sizes[src]:
            ops.append(dist.P2POp(dist.irecv, arrived[src], _peer(group, src), group=group))
        if stats is not None:
            sent = pieces[dst].numel() * pieces[dst].element_size()
            stats.sent_bytes += sent
            stats.received_bytes += arrived[src].numel() * arrived[src].element_size()
            stats.messages += bool(send_sizes[dst])
            if isinstance(stats, EPStats):
                stats.exchanges[name] = stats.exchanges.get(name, 0) + sent
        for request in dist.batch_isend_irecv(ops) if ops else []:   # point-to-point, paired
            request.wait()
    return torch.cat(arrived)


class _AllToAll(torch.autograd.Function):
    """The gradient of an all-to-all is the all-to-all back, with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group, stats, name):
        ctx.options = (send_sizes, recv_sizes, group, stats, name)
        return all_to_all_variable(x, send_sizes, recv_sizes, group, stats=stats, name=name)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes, group, stats, name = ctx.options
        back = None if stats is None else stats.backward
        return (all_to_all_variable(grad.contiguous(), recv_sizes, send_sizes, group, stats=back,
                                    name=name), None, None, None, None, None)


# ---------------------------------------------------------------- the expert-parallel layer

def expert_owner(expert: int, num_experts: int, world: int) -> int:
    """The rank that holds `expert`: rank r holds experts r·E/W ... (r+1)·E/W - 1."""
    return expert // (num_experts // world)


class ExpertParallelMoE(nn.Module):
    """Rank's share of a `MoE`: the router copied, experts r·E/W ... (r+1)·E/W - 1 copied.

    `forward(x, stats=None)` takes this rank's (n, width) tokens and returns their outputs; capacity
    and the aux loss (`self.routing`) are computed over these n tokens, as `MoE(groups=W)` does
    per group. Call `all_reduce_router_grads` after backward."""

    def __init__(self, moe: MoE, rank: int, world: int, *, group=None):
        super().__init__()
        E = len(moe.experts)
        if world < 1 or E % world or not 0 <= rank < world:
            raise ValueError(f"expert parallelism gives each of W={world} ranks E/W whole experts:"
                             f" {E} experts do not divide by {world} (or rank {rank} is not in "
                             f"0..{world - 1}); use a number of experts that is a multiple of W")
        self.rank, self.world, self.group, self.num_experts = rank, world, group, E
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.router = copy.deepcopy(moe.router)                  # replicated: data parallel
        local = range(rank * E // world, (rank + 1) * E // world)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in local)
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor, *, stats: EPStats | None = None) -> torch.Tensor:
        _check_tokens(x, self.router.weight)
        if dist.get_world_size(self.group) != self.world:
            raise ValueError(f"the layer was split for W={self.world} ranks but its process "
                             f"group has {dist.get_world_size(self.group)}")
        W, E, L = self.world, self.num_experts, self.num_experts // self.world
        if stats is not None and stats.backward is None:
            stats.backward = EPStats()
        # 1. route this rank's tokens; the kept assignments sorted by expert (so by owner rank)
        self.routing = r = route(self.router(x), self.top_k, capacity_factor=self.capacity_factor)
        flat = torch.nonzero(r.kept.flatten(), as_tuple=True)[0]
        flat = flat[torch.sort(r.expert.flatten()[flat], stable=True).indices]
        token, choice = flat // self.top_k, flat % self.top_k    # (m,) each
        counts = torch.bincount(r.expert[token, choice], minlength=E)          # (E,) int64
        # 2. all-to-all of the counts: row s of `incoming` = rank s's tokens for my L experts
        incoming = all_to_all_variable(counts.view(W, L), [1] * W, [1] * W, self.group,
                                       stats=stats, name="counts")            # (W, L)
        send, recv = counts.view(W, L).sum(1).tolist(), incoming.sum(1).tolist()
        # 3. dispatch: (m, d) rows to their experts' ranks -> (R, d) rows from every rank
        rows = _AllToAll.apply(x[token], send, recv, self.group, stats, "dispatch")
        # 4. each local expert on its rows from all ranks (source-major, expert-minor blocks)
        out = self._run_experts(rows, incoming, stats)
        # 5. combine: back to the tokens' ranks, weighted sum per token
        back = _AllToAll.apply(out, recv, send, self.group, stats, "combine")  # (m, d)
        y = torch.zeros_like(x).index_add(0, token, back * r.weight[token, choice, None])
        if stats is not None:
            stats.routed, stats.kept, stats.dropped = r.routed, counts, r.dropped
            stats.received_tokens = sum(recv)
        return y

    def _run_experts(self, rows: torch.Tensor, incoming: torch.Tensor,
                     stats: EPStats | None) -> torch.Tensor:
        W, L = incoming.shape
        blocks = list(rows.split(incoming.flatten().tolist()))  # block s·L + j: rank s, expert j
        params = {p.data_ptr() for p in self.parameters()}
        saved: dict[tuple, int] = {}

        def keep(t):                                             # activations saved, not weights
            if t.data_ptr() not in params:
                saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
            return t

        outs = []
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            for j, expert in enumerate(self.experts):
                y = expert(torch.cat([blocks[s * L + j] for s in range(W)]))  # (tokens of j, d)
                outs.append(list(y.split(incoming[:, j].tolist())))
        if stats is not None:
            stats.activation_bytes += sum(saved.values())
        return torch.cat([outs[j][s] for s in range(W) for j in range(L)])  # back in rows' order


def all_reduce_router_grads(module: ExpertParallelMoE) -> None:
    """Sum the replicated router's gradient over the ranks (collective, uncounted)."""
    grad = module.router.weight.grad
    if grad is not None:
        dist.all_reduce(grad, group=module.group)


# ---------------------------------------------------------------- the formulas

def ep_bytes_per_rank(kept: torch.Tensor, width: int, dtype: torch.dtype) -> list[dict]:
    """Bytes each rank sends per all-to-all, from the (W, E) routing counts: kept[s, e] is how many
    of rank s's tokens go to expert e. Rank r sends: counts (W-1)·E/W·8 (int64); dispatch its rows
    for other ranks' experts, Σ_{e not r's} kept[r, e]·d·b; combine the rows it received from other
    ranks, Σ_{s≠r} Σ_{e r's} kept[s, e]·d·b. Backward: combine's gradient as dispatch went and
    dispatch's as combine went, so the same two token figures (no counts)."""
    W, E = kept.shape
    row = width * torch.empty((), dtype=dtype).element_size()
    owner = torch.arange(E) // (E // W)
    result = []
    for r in range(W):
        mine, other = owner == r, torch.arange(W) != r
        result.append({"counts": (W - 1) * (E // W) * 8,
                       "dispatch": int(kept[r, ~mine].sum()) * row,
                       "combine": int(kept[other][:, mine].sum()) * row})
    return result


def expert_weight_bytes(width: int, hidden: int, num_experts: int, world: int,
                        dtype: torch.dtype = torch.float32) -> int:
    """Expert parameters per rank: E/W MLPs of 2·d·h + h + d elements (the router, d·E, is
    replicated beside them)."""
    per = 2 * width * hidden + hidden + width
    return num_experts // world * per * torch.empty((), dtype=dtype).element_size()


def expert_activation_bytes(received_tokens: int, width: int, hidden: int,
                            dtype: torch.dtype = torch.float32) -> int:
    """Bytes a rank's experts save for backward for R received rows: each MLP keeps its input (d),
    fc's output for GELU (h) and GELU's output for the second Linear (h): R·(d + 2h)·b."""
    return received_tokens * (width + 2 * hidden) * torch.empty((), dtype=dtype).element_size()


def load_imbalance(counts: torch.Tensor, world: int) -> dict[str, float]:
    """Max over mean of tokens per expert, and of tokens per rank (its E/W experts' sum), from
    (E,) or (W, E) assignment counts; 1.0 is perfect balance, E (or W) all on one."""
    per_expert = counts.reshape(-1, counts.shape[-1]).sum(dim=0).double()
    if per_expert.numel() % world:
        raise ValueError(f"{per_expert.numel()} experts do not split over {world} ranks")
    per_rank = per_expert.view(world, -1).sum(dim=1)
    return {"expert": float(per_expert.max() / per_expert.mean()),
            "rank": float(per_rank.max() / per_rank.mean())}
