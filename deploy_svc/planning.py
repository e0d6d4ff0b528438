"""The whole deploy decision, free of gRPC and Redis.

Which hardware type an intent is ranked for (:func:`hardware_order`: the types of the
live devices, most devices first), whether the devices are CUDA devices
(:func:`on_cuda`), which devices may take the configuration (:func:`candidates_for`),
and :func:`decide`, which walks the options in rank order and takes the first one the
engine can run and the devices can hold, placing it with
:func:`deploy_svc.placement.place`. Every better-ranked option it passes over is recorded
with the reason, so the response can explain the choice. The controller only gathers the
inputs (:class:`Prepared`: the model, limits, the estimator's ranking) and device state,
then reserves, launches and records what :func:`decide_on` chose, and the further
replicas :func:`replica_placements` places beside it.

Memory of one rank holding ``k`` decoder layers is ``fixed + k * block``, as
:func:`services.reservation.memory_blocks` sizes it from the shape and the estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from deploy_svc import placement
from deploy_svc.explicit import ExplicitPlan, resolve_explicit
from deploy_svc.objectives import BatchBound, batch_bound, largest_fitting, ttft_batch_bound
from services.api import common_pb2 as common
from services.api import deployment_service_pb2 as deploy_pb
from services.api import estimator_service_pb2 as estimator_pb
from services.api import model_service_pb2 as model_pb
from services.engine_rules import default_dtype
from services.errors import InvalidArgument, IServeError, ResourceExhausted, shown
from services.estimation.score import is_unfit_note
from services.ids import check_device_id, check_hardware_type, check_node_id
from services.intents import COST_FIELDS, COST_UNITS
from services.proto_limits import MAX_DEVICE_BYTES
from services.reservation import memory_blocks
from services.settings import GIB
from services.simulation import MAX_SIMULATED_DEVICES
from services.state.capacity import free_bytes

POLICIES = {
    common.PLACEMENT_POLICY_UNSPECIFIED: "hybrid",
    common.PLACEMENT_POLICY_HYBRID: "hybrid",
    common.PLACEMENT_POLICY_PACKING: "packing",
    common.PLACEMENT_POLICY_LEAST_LOADED: "least-loaded",
}
# Reasons are listed in the error when nothing can be placed; beyond this many, counted.
MAX_LISTED_REASONS = 5


class NothingPlaced(ResourceExhausted):
    """No option could be placed: the message, and ``tried``, each option's reason."""

    def __init__(self, message: str, tried: str = ""):
        super().__init__(message)
        self.tried = tried


@dataclass(frozen=True)
class Option:
    """One configuration to try: its 1-based rank and, when ranked, its estimate."""

    rank: int
    config: common.DeploymentConfig
    estimate: estimator_pb.ConfigEstimate | None = None
    meets_intent: bool = True
    # What of the intent a fallback misses (the estimator's words), or "".
    shortfall: str = ""


@dataclass(frozen=True)
class Prepared:
    """A request's decision inputs that do not change while it is retried."""

    model: model_pb.Model
    limits: ExplicitPlan
    policy: str
    cuda: bool
    options: list[Option]
    hardware_type: str | None  # None: any device (an explicit configuration)
    note: str
    nodes: list[common.NodeState]  # as seen when the request was prepared
    objectives: common.ServiceObjectives
    auto_batch: bool  # the request left the batch size to the deployer
    # A COST_SLO intent's (cost formula, budget): the batch chosen stays within it.
    cost_budget: tuple[int, float] | None = None
    # The kind of intent the request is ranked by (None: an explicit configuration); what
    # it asks of the batch size, the properties below say.
    intent_kind: int | None = None

    @property
    def latency_first(self) -> bool:
        """Ranked by latency (MIN_LATENCY; COST_SLO: the fastest within the budget):
        without a TTFT objective, its batch keeps TTFT near batch 1's (a request's cost
        falls as the batch grows, and a cost-slo deployment within its budget at batch
        64 took 4x the latency it was ranked first for)."""
        return self.intent_kind in (common.INTENT_KIND_MIN_LATENCY, common.INTENT_KIND_COST_SLO)

    @property
    def memory_first(self) -> bool:
        """MIN_MEMORY: its batch stays 1 (each more sequence's KV cache is memory)."""
        return self.intent_kind == common.INTENT_KIND_MIN_MEMORY

    @property
    def throughput_first(self) -> bool:
        """Ranked by throughput or device-hours (MAX_THROUGHPUT, MIN_DEVICE_HOURS):
        without a TPOT objective its batch is not held near batch 1's TPOT."""
        return self.intent_kind in (
            common.INTENT_KIND_MAX_THROUGHPUT,
            common.INTENT_KIND_MIN_DEVICE_HOURS,
        )


def hardware_order(nodes: Sequence[common.NodeState]) -> list[tuple[str, int]]:
    """(hardware type, live devices) of every type among the live nodes, most devices
    first: the order an intent is ranked in until the model is profiled on one."""
    counts: dict[str, int] = {}
    for node in nodes:
        if node.alive:
            for dev in node.devices:
                counts[dev.hardware_type] = counts.get(dev.hardware_type, 0) + 1
    return sorted(counts.items(), key=lambda item: -item[1])


def on_cuda(nodes: Sequence[common.NodeState]) -> bool:
    """Whether the live devices include CUDA devices (which also serve float16)."""
    return any(d.kind == common.DEVICE_KIND_CUDA for n in nodes if n.alive for d in n.devices)


def candidates_for(
    nodes: Sequence[common.NodeState], hardware_type: str | None
) -> list[placement.Candidate]:
    """The devices a configuration ranked for ``hardware_type`` may go on (any: None)."""
    return [
        c
        for c in placement.candidates(nodes)
        if hardware_type is None or c.hardware_type == hardware_type
    ]


def decide_on(
    prepared: Prepared,
    nodes: Sequence[common.NodeState],
    excluded: Mapping[int, str] | None = None,
) -> deploy_pb.DeploymentDecision:
    """:func:`decide` for ``prepared`` on the devices of ``nodes`` it may use."""
    return decide(
        prepared.model,
        prepared.options,
        candidates_for(nodes, prepared.hardware_type),
        prepared.limits,
        policy=prepared.policy,
        excluded=excluded,
        note=prepared.note,
        cuda=prepared.cuda,
    )


def hardware_of(decision: deploy_pb.DeploymentDecision, nodes: Sequence[common.NodeState]) -> str:
    """The hardware type of the decision's first device ("" when not among ``nodes``)."""
    first = decision.placement.stages[0].devices[0]
    for node in nodes:
        for dev in node.devices:
            if (dev.ref.node_id, dev.ref.device_id) == (first.node_id, first.device_id):
                return dev.hardware_type
    return ""


def matching_estimate(
    estimates: Sequence[estimator_pb.ConfigEstimate], config: common.DeploymentConfig
) -> estimator_pb.ConfigEstimate | None:
    """The estimate of ``config``'s layout and compression (by variant name when the
    configuration names one), or None."""

    def key(c: common.DeploymentConfig) -> tuple:
        return (c.tensor_parallel, c.pipeline_parallel, c.weight_quant, c.kv_quant, c.pruning)

    for estimate in estimates:
        same_variant = (
            not config.variant_name or estimate.config.variant_name == config.variant_name
        )
        if same_variant and key(estimate.config) == key(config):
            return estimate
    return None


def unprofiled_dtype(prepared: Prepared, config: common.DeploymentConfig) -> str:
    """Why the model's estimates do not describe ``config``, or "" when they do: profiling
    jobs compute in engine_rules.default_dtype's precision, and a dtype asked for by name
    (bfloat16 on CPUs) runs at a speed and in memory those profiles never measured."""
    profiled = default_dtype(prepared.model.shape.dtype, cuda=prepared.cuda)
    if config.dtype in (common.PRECISION_UNSPECIFIED, profiled):
        return ""
    if prepared.model.state != model_pb.MODEL_STATE_PROFILED:
        # A probe read "was profiled in float32" of a model registered without profiling.
        return f"no estimate: {prepared.model.model_id} has no profile"
    return (
        f"no estimate: {prepared.model.model_id} was profiled in {_dtype_name(profiled)}, "
        f"this deployment computes in {_dtype_name(config.dtype)}"
    )


def _dtype_name(precision: int) -> str:
    return common.Precision.Name(precision).removeprefix("PRECISION_").lower()


def policy_name(policy: int) -> str:
    """The placement module's name of a PlacementPolicy value; ValueError when unknown."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy}")
    return POLICIES[policy]


def options_from_ranking(ranked: Sequence[estimator_pb.RankedConfig]) -> list[Option]:
    return [
        Option(r.rank, r.estimate.config, r.estimate, r.meets_intent, r.shortfall) for r in ranked
    ]


def _engine_problem(
    model: model_pb.Model, config: common.DeploymentConfig, limits: ExplicitPlan, cuda: bool
) -> tuple[common.DeploymentConfig | None, str]:
    """The configuration as the engine will run it, or None and why it cannot."""
    try:
        plan = resolve_explicit(
            model,
            config,
            batch_size=config.batch_size or limits.config.batch_size,
            max_input_tokens=limits.max_input_tokens,
            max_output_tokens=limits.max_output_tokens,
            cuda=cuda,
        )
    except IServeError as exc:
        return None, f"the engine cannot run it: {exc}"
    return plan.config, ""


def describe(config: common.DeploymentConfig) -> str:
    parts = [f"tp={config.tensor_parallel}", f"pp={config.pipeline_parallel}"]
    if config.variant_name:
        parts.append(f"variant={config.variant_name}")
    parts.append(f"batch={config.batch_size or 1}")
    return " ".join(parts)


def decide(
    model: model_pb.Model,
    options: Sequence[Option],
    devices: Sequence[placement.Candidate],
    limits: ExplicitPlan,
    *,
    policy: str = "hybrid",
    excluded: Mapping[int, str] | None = None,
    note: str = "",
    cuda: bool = False,
) -> deploy_pb.DeploymentDecision:
    """The first option, in rank order, the engine can run and ``devices`` can hold.

    ``excluded`` maps ranks already tried (e.g. whose launch failed) to why; ``cuda``
    says the devices are CUDA devices (which also serve float16). Raises
    ResourceExhausted, naming the reasons, when no option can be placed.
    """
    excluded = excluded or {}
    skipped: list[deploy_pb.SkippedConfig] = []
    for option in options:
        reason = excluded.get(option.rank, "")
        config = None
        if not reason:
            config, reason = _engine_problem(model, option.config, limits, cuda)
        if config is not None:
            tp, pp = config.tensor_parallel, config.pipeline_parallel
            estimated = option.estimate.memory_total_bytes if option.estimate else 0
            fixed, block = memory_blocks(model.shape, config, limits.max_seq_len, estimated)
            layers = model.shape.num_layers
            choice = placement.place(
                devices,
                tp=tp,
                pp=pp,
                num_layers=layers,
                fixed_bytes=fixed,
                layer_bytes=block,
                policy=policy,
            )
            if choice is not None:
                return _decision(option, config, choice, skipped, note)
            reason = "no room: " + placement.explain_no_fit(
                devices, tp=tp, pp=pp, num_layers=layers, fixed_bytes=fixed, layer_bytes=block
            )
        skipped.append(
            deploy_pb.SkippedConfig(rank=option.rank, config=option.config, reason=reason)
        )
    listed = "; ".join(
        f"#{s.rank} {describe(s.config)}: {s.reason}" for s in skipped[:MAX_LISTED_REASONS]
    )
    more = len(skipped) - MAX_LISTED_REASONS
    # The ranking left out what cannot fit the devices' memory at all; a refusal that
    # listed the others only read as if those had not been considered.
    unfit = next((p for p in note.split("; ") if is_unfit_note(p)), "")
    tried = f"{listed}{f'; and {more} more' if more > 0 else ''}"
    ranked_out = f"; {unfit}, ranked out" if unfit else ""
    if not skipped:
        raise NothingPlaced(
            f"no configuration of {model.model_id} to place" + (f" ({note})" if note else "")
        )
    raise NothingPlaced(
        f"no configuration of {model.model_id} can be placed on the {len(devices)} "
        f"device(s) available ({tried}){ranked_out}",
        tried + ranked_out,
    )


def _decision(
    option: Option,
    config: common.DeploymentConfig,
    choice: placement.PlacementChoice,
    skipped: list[deploy_pb.SkippedConfig],
    note: str,
) -> deploy_pb.DeploymentDecision:
    notes = [note] if note else []
    if not option.meets_intent:
        notes.append(
            f"configuration #{option.rank} is a fallback: "
            + (option.shortfall or "it does not meet the intent")
        )
    if option.estimate is not None and option.estimate.communication_unprofiled:
        notes.append(
            f"configuration #{option.rank} splits the model a way its fingerprints never "
            "ran (tp = 2 or pp = 2 was not profiled): its estimate leaves out that "
            "communication, so it will run slower than estimated"
        )
    if choice.uneven:
        counts = "+".join(str(s.layer_count) for s in choice.stages)
        notes.append(
            f"uneven layer map {counts}: the even split does not fit the devices' free memory"
        )
    decision = deploy_pb.DeploymentDecision(
        config=config,
        placement=placement_of(choice),
        winner_rank=option.rank,
        skipped=skipped,
        note="; ".join(notes),
    )
    if option.estimate is not None:
        decision.estimate.CopyFrom(option.estimate)
    decision.estimate.config.CopyFrom(config)
    if not decision.estimate.memory_total_bytes:
        # No estimate: what the placement reserves, in both figures (the estimator's
        # are the engine's alone; the reservations add each worker's runtime).
        reserved = [stage.bytes_per_device for stage in choice.stages for _ in stage.devices]
        decision.estimate.memory_total_bytes = sum(reserved)
        decision.estimate.memory_per_device_bytes = max(reserved)
    return decision


def with_estimate(
    prepared: Prepared,
    decision: deploy_pb.DeploymentDecision,
    nodes: Sequence[common.NodeState],
    batch1: estimator_pb.ConfigEstimate,
    batch2: estimator_pb.ConfigEstimate | None,
) -> deploy_pb.DeploymentDecision:
    """``decision``, where it has no estimate of its own (an explicit configuration,
    ranked by nothing), placed again on its devices with the estimator's figures for its
    configuration at its batch (``batch1`` itself, or :func:`at_batch`'s with a measured
    ``batch2``): its ranks then reserve what the estimate says, as a ranked choice's do,
    not the shape's figure alone (an explicit deployment of a profiled model showed no
    estimate and reserved less than it, a probe). Where the estimate does not fit its
    devices, the shape's reservations stay and the note says so; where the batch's
    figures are unknown, it is unchanged."""
    if decision.estimate.latency_ms:
        return decision
    batch = max(1, decision.config.batch_size)
    if batch > 1 and (batch2 is None or not batch2.batch_measured):
        return decision
    placed = _decide_batch(prepared, decision, nodes, batch1, batch2 or batch1, batch)
    if placed is not None:
        # The decision's notes (the batch's reason among them), and any the new
        # placement adds (an uneven layer map).
        kept = decision.note.split("; ") if decision.note else []
        added = [n for n in placed.note.split("; ") if n and n not in kept]
        placed.note = "; ".join(kept + added)
        return placed
    estimate = at_batch(batch1, batch2 or batch1, batch)
    out = deploy_pb.DeploymentDecision()
    out.CopyFrom(decision)
    out.estimate.CopyFrom(estimate)
    out.estimate.config.CopyFrom(decision.config)
    return with_note(
        out,
        f"its estimate ({estimate.memory_per_device_bytes / GIB:.2f} GiB a device) does not "
        "fit its devices' free memory: they reserve what its shape needs, and it may run "
        "out of memory",
    )


def placement_of(choice: placement.PlacementChoice) -> common.Placement:
    return common.Placement(
        stages=[
            common.StagePlacement(
                stage=index,
                first_layer=stage.first_layer,
                layer_count=stage.layer_count,
                devices=[
                    common.DeviceRef(node_id=d.node_id, device_id=d.device_id)
                    for d in stage.devices
                ],
                reserved_bytes=[stage.bytes_per_device] * len(stage.devices),
            )
            for index, stage in enumerate(choice.stages)
        ]
    )


def _winner(prepared: Prepared, decision: deploy_pb.DeploymentDecision) -> Option | None:
    """The option the decision took, as ranked (None when there is no such rank)."""
    return next((o for o in prepared.options if o.rank == decision.winner_rank), None)


def meets_intent(prepared: Prepared, decision: deploy_pb.DeploymentDecision) -> bool:
    """Whether the decision's configuration met the intent it was ranked for (False: a
    fallback; an explicit configuration meets it)."""
    winner = _winner(prepared, decision)
    return winner is None or winner.meets_intent


def size_batch(
    prepared: Prepared,
    decision: deploy_pb.DeploymentDecision,
    nodes: Sequence[common.NodeState],
    batch1: estimator_pb.ConfigEstimate | None,
    batch2: estimator_pb.ConfigEstimate | None,
    objectives: common.ServiceObjectives,
) -> deploy_pb.DeploymentDecision:
    """``decision`` (made at batch 1) at the batch size the deployer chooses for a
    Deploy that left it 0: the largest batch whose estimates meet the ``objectives``
    (:func:`deploy_svc.objectives.batch_bound`) and whose KV cache still fits the
    devices it was placed on, placed again on them, with its estimate's times and costs
    at that batch; its note says which bound decided. ``batch1``/``batch2`` are the
    chosen configuration's estimates at batch 1 and 2 (None: not profiled on this
    hardware). Without both, or without batch-2 profiles, the batch stays 1: a batch's
    cost is unknown."""
    if prepared.memory_first:
        # Sized for TPOT, a min-memory deployment held 64 sequences' KV cache: 22 % more
        # memory than the footprint it was ranked on.
        return with_note(
            decision,
            "batch 1: a min-memory intent holds one sequence's KV cache (--batch B for more)",
        )
    if batch1 is None:
        return with_note(decision, "batch 1: no estimate of this configuration's TPOT")
    if batch2 is None or not batch2.batch_measured:
        return with_note(decision, "batch 1: the model was not profiled at batch 2")
    bound = batch_bound(batch1, batch2, objectives, throughput_first=prepared.throughput_first)
    if prepared.cost_budget is not None and not meets_intent(prepared, decision):
        # No configuration met the budget at batch 1 (the ranking's batch): a larger
        # batch shares the devices' cost between its requests, so the smallest that meets
        # it is taken, else the cheapest. Capped near batch 1's TTFT instead, every
        # budget below a request's cost at batch 1 was refused, though min-cost's own
        # choice met it (a probe).
        bound = BudgetBatches.of(batch1, batch2, *prepared.cost_budget, bound.batch).reach()
    else:
        if prepared.latency_first and not objectives.ttft_slo_ms:
            ttft = ttft_batch_bound(batch1.ttft_ms, batch2.ttft_ms)
            bound = ttft if ttft.batch < bound.batch else bound
        if prepared.cost_budget is not None:
            budget = BudgetBatches.of(batch1, batch2, *prepared.cost_budget, bound.batch).largest()
            bound = budget if budget.batch < bound.batch else bound
    decisions: dict[int, deploy_pb.DeploymentDecision] = {1: decision}

    def at(batch: int) -> deploy_pb.DeploymentDecision | None:
        if batch not in decisions:
            decisions[batch] = _decide_batch(prepared, decision, nodes, batch1, batch2, batch)
        return decisions[batch]

    batch = largest_fitting(bound.batch, lambda b: at(b) is not None)
    chosen = at(batch)
    assert chosen is not None  # batch 1 is the decision itself
    return with_note(chosen, _batch_reason(batch, bound))


@dataclass(frozen=True)
class BudgetBatches:
    """A request's cost in a COST_SLO intent's formula at each batch from 1 up (its
    :func:`at_batch` figure), against the intent's budget. A request's GB x s and
    device-hours fall with the batch while the batch's latency grows slower than its
    size, then rise; the memory cost only rises. Every batch is looked at (at most
    MAX_AUTO_BATCH, arithmetic only)."""

    what: str  # the budget, as a note names it
    costs: dict[int, float]
    budget: float

    @classmethod
    def of(
        cls,
        batch1: estimator_pb.ConfigEstimate,
        batch2: estimator_pb.ConfigEstimate,
        cost_formula: int,
        budget: float,
        upper: int,
    ) -> BudgetBatches:
        formula = cost_formula or common.COST_FORMULA_MEMORY_TIMES_LATENCY
        field = COST_FIELDS[formula]
        costs = {b: getattr(at_batch(batch1, batch2, b), field) for b in range(1, upper + 1)}
        return cls(f"the cost budget of {budget:g} {COST_UNITS.get(formula, '')}", costs, budget)

    @property
    def within(self) -> list[int]:
        return [b for b, cost in self.costs.items() if cost <= self.budget]

    def largest(self) -> BatchBound:
        """The largest batch within the budget; 1 when none is (a fallback, ranked
        cheapest)."""
        return BatchBound(max(self.within, default=1), self.what)

    def reach(self) -> BatchBound:
        """For a budget no configuration meets at batch 1: the smallest batch within it
        (the lowest latency that meets it), else the cheapest batch."""
        if self.within:
            return BatchBound(min(self.within), f"{self.what}, met from this batch on")
        cheapest = min(self.costs, key=lambda b: (self.costs[b], b))
        return BatchBound(cheapest, f"the least cost per request ({self.what} is met at no batch)")


def at_batch(
    batch1: estimator_pb.ConfigEstimate, batch2: estimator_pb.ConfigEstimate, batch: int
) -> estimator_pb.ConfigEstimate:
    """``batch1`` at ``batch`` sequences as the estimator scores it (MaverIQ Eq. 6): TTFT,
    TPOT and latency on the line through the batch-1 and batch-2 estimates, never below
    batch 1's; memory grows by one sequence's KV cache per extra sequence; the costs and
    throughput follow (device-hours and GB x s scale with latency, throughput with
    batch / latency), each request charged 1/``batch`` of the batch's GB x s and
    device-hours (services.estimation.score.Estimates)."""
    out = estimator_pb.ConfigEstimate()
    out.CopyFrom(batch1)
    out.config.batch_size = batch
    extra = batch - 1
    for field in ("ttft_ms", "tpot_ms", "latency_ms"):
        one, two = getattr(batch1, field), getattr(batch2, field)
        setattr(out, field, one + extra * max(0.0, two - one))
    out.memory_total_bytes = batch1.memory_total_bytes + extra * batch1.kv_cache_bytes
    # Each device holds its share of the extra sequences' KV cache (the estimator's
    # per-device figure is the total over tp x pp devices); it stayed batch 1's (a probe).
    devices = max(1, batch1.config.tensor_parallel) * max(1, batch1.config.pipeline_parallel)
    out.memory_per_device_bytes = batch1.memory_per_device_bytes + round(
        extra * batch1.kv_cache_bytes / devices
    )
    out.kv_cache_bytes = batch1.kv_cache_bytes * batch
    if batch1.latency_ms > 0 and batch1.memory_total_bytes > 0:
        slower = out.latency_ms / batch1.latency_ms
        bigger = out.memory_total_bytes / batch1.memory_total_bytes
        out.cost_device_hours = batch1.cost_device_hours * slower / batch
        out.cost_memory = batch1.cost_memory * bigger
        out.cost_memory_latency = batch1.cost_memory_latency * slower * bigger / batch
        out.throughput_tokens_per_second_per_device = (
            batch1.throughput_tokens_per_second_per_device * batch / slower
        )
    return out


def _decide_batch(
    prepared: Prepared,
    decision: deploy_pb.DeploymentDecision,
    nodes: Sequence[common.NodeState],
    batch1: estimator_pb.ConfigEstimate,
    batch2: estimator_pb.ConfigEstimate,
    batch: int,
) -> deploy_pb.DeploymentDecision | None:
    """The decision's configuration at ``batch``, placed anew; None when it does not fit.
    Its estimate is :func:`at_batch`'s."""
    config = common.DeploymentConfig()
    config.CopyFrom(decision.config)
    config.batch_size = batch
    estimate = at_batch(batch1, batch2, batch)
    estimate.config.CopyFrom(config)
    limits = ExplicitPlan(
        config, prepared.limits.max_input_tokens, prepared.limits.max_output_tokens
    )
    placed = _devices_of(decision.placement)
    devices = [
        c
        for c in candidates_for(nodes, prepared.hardware_type)
        if (c.node_id, c.device_id) in placed
    ]
    winner = _winner(prepared, decision)
    option = Option(decision.winner_rank, config, estimate)
    if winner is not None:
        # The ranking's words describe the batch it ranked, not this one.
        shortfall = winner.shortfall and (
            f"{winner.shortfall} (as ranked, at batch {batch1.config.batch_size or 1})"
        )
        option = replace(option, meets_intent=winner.meets_intent, shortfall=shortfall)
    try:
        sized = decide(
            prepared.model,
            [option],
            devices,
            limits,
            policy=prepared.policy,
            note=prepared.note,
            cuda=prepared.cuda,
        )
    except ResourceExhausted:
        return None
    sized.skipped.extend(decision.skipped)
    return sized


def replica_placements(
    prepared: Prepared,
    decision: deploy_pb.DeploymentDecision,
    nodes: Sequence[common.NodeState],
    count: int,
) -> list[common.Placement]:
    """Where replicas 1 … ``count`` - 1 of ``decision``'s configuration go (replica 0 is
    the decision's own placement): each on devices of ``nodes`` that no other replica
    uses, of replica 0's hardware type, every rank reserving what a rank of replica 0
    reserves per layer. Raises ResourceExhausted naming the first replica without room."""
    config = decision.config
    tp, pp = config.tensor_parallel, config.pipeline_parallel
    fixed, _ = memory_blocks(prepared.model.shape, config, prepared.limits.max_seq_len)
    first = decision.placement.stages[0]
    block = (first.reserved_bytes[0] - fixed) // first.layer_count
    hardware_type = hardware_of(decision, nodes) or prepared.hardware_type
    taken = _devices_of(decision.placement)
    placements: list[common.Placement] = []
    for index in range(1, count):
        left = [
            c for c in candidates_for(nodes, hardware_type) if (c.node_id, c.device_id) not in taken
        ]
        layers = prepared.model.shape.num_layers
        choice = placement.place(
            left,
            tp=tp,
            pp=pp,
            num_layers=layers,
            fixed_bytes=fixed,
            layer_bytes=block,
            policy=prepared.policy,
        )
        if choice is None:
            why = (
                f"{len(left)} device(s) not taken by the other replicas, tp={tp} x pp={pp} "
                f"needs {tp * pp}"
                if len(left) < tp * pp
                else placement.explain_no_fit(
                    left, tp=tp, pp=pp, num_layers=layers, fixed_bytes=fixed, layer_bytes=block
                )
            )
            raise ResourceExhausted(
                # Counted from 1, as read ("replica 1 of 2" named the second).
                f"replica {index + 1} of {count} of {prepared.model.model_id} "
                f"({describe(config)}, each replica on devices of its own) cannot be "
                f"placed: {why}"
            )
        placements.append(placement_of(choice))
        taken |= _devices_of(placements[-1])
    return placements


def _devices_of(where: common.Placement) -> set[tuple[str, str]]:
    return {(d.node_id, d.device_id) for stage in where.stages for d in stage.devices}


def _batch_reason(batch: int, bound: BatchBound) -> str:
    if batch == bound.batch:
        return f"batch {batch}: bounded by {bound.reason}"
    return f"batch {batch}: the KV cache of batch {batch + 1} does not fit the devices"


def with_note(decision: deploy_pb.DeploymentDecision, note: str) -> deploy_pb.DeploymentDecision:
    decision.note = "; ".join(n for n in (decision.note, note) if n)
    return decision


def simulated_nodes(simulated: Sequence[common.DeviceState]) -> list[common.NodeState]:
    """PlanDeployment's simulated devices as live nodes (a device without a node id is
    on node "simulated"; free bytes default to total minus max(used, reserved)).
    InvalidArgument for a device without id, hardware type or total, or a load outside
    [0, 1], and for more than MAX_SIMULATED_DEVICES devices."""
    if len(simulated) > MAX_SIMULATED_DEVICES:
        raise InvalidArgument(
            f"at most {MAX_SIMULATED_DEVICES} simulated devices, got {len(simulated)}"
        )
    nodes: dict[str, common.NodeState] = {}
    seen: set[tuple[str, str]] = set()
    for given in simulated:
        dev = common.DeviceState()
        dev.CopyFrom(given)
        dev.ref.node_id = dev.ref.node_id or "simulated"
        key = (dev.ref.node_id, dev.ref.device_id)
        # A fuzzing tester's megabyte node id came back whole in the message.
        check_node_id(key[0])
        name = f"simulated device {key[0]}/{shown(key[1])}"
        if not dev.ref.device_id or key in seen:
            raise InvalidArgument(f"{name}: every device needs a device_id, unique in its node")
        check_device_id(dev.ref.device_id)
        if not dev.hardware_type or not dev.total_bytes:
            raise InvalidArgument(f"{name} needs hardware_type and total_bytes")
        if dev.total_bytes > MAX_DEVICE_BYTES:
            raise InvalidArgument(
                f"{name}: total_bytes {dev.total_bytes} is over {MAX_DEVICE_BYTES} (1 PiB), "
                "more than any device holds"
            )
        check_hardware_type(dev.hardware_type)
        if not 0.0 <= dev.load <= 1.0:
            raise InvalidArgument(f"{name}: load must be in [0, 1]")
        if dev.kind not in common.DeviceKind.values():
            raise InvalidArgument(f"{name}: kind {dev.kind} is not a DeviceKind")
        for field in ("free_bytes", "used_bytes", "reserved_bytes"):
            if getattr(dev, field) > dev.total_bytes:
                raise InvalidArgument(
                    f"{name}: {field} {getattr(dev, field)} exceeds total_bytes {dev.total_bytes}"
                )
        room = free_bytes(dev.total_bytes, dev.used_bytes, dev.reserved_bytes)
        if dev.free_bytes > room:
            raise InvalidArgument(
                f"{name}: free_bytes {dev.free_bytes} exceeds what used_bytes and "
                f"reserved_bytes leave of total_bytes ({room})"
            )
        seen.add(key)
        if not dev.free_bytes:
            dev.free_bytes = room
        node = nodes.setdefault(key[0], common.NodeState(node_id=key[0], alive=True))
        node.devices.append(dev)
    return list(nodes.values())
