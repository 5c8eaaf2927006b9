"""CheckpointManager, the engine's checkpoint component: when to save, what to resume from, the emergency save,
failure accounting.

It is a component like the validator (the loop hands it the runtime and metrics; it decides its own timing) and
the one place that orchestrates saving and resuming: the save cadence, the sync or background writer, the
sharded commit (every rank's files reported to rank 0 before the manifest), the memory tier's set-up and the
two tiers' agreement on the step to resume from. What it orchestrates is the storage library below the engine,
`trainer.checkpoint` (layout, format, store, writer, state, sharded files, lease, memory tier), which knows
nothing of runs, ranks' roles or tasks.
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from trainer import __version__
from trainer.checkpoint.lease import Holder, Lease, LeaseError, LeaseLost, present_holder
from trainer.checkpoint.memory import INDEX, OWNER, MemoryTier, agree, make_root, memory_root
from trainer.checkpoint.sharded import LOCAL_INDEX, write_sharded_step
from trainer.checkpoint.state import (
    Stateful,
    capture_rank_state,
    read_frozen_records,
    read_state,
    sharded_snapshot_files,
    snapshot_files,
    updated_only_in_steps,
)
from trainer.checkpoint.store import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointInfo,
    CheckpointStore,
    SaveResult,
    Timeline,
    new_owner_id,
)
from trainer.checkpoint.validity import FrozenRecord, InputRecord
from trainer.checkpoint.view import check_pinned_inputs
from trainer.checkpoint.writer import Checkpointer, SnapshotError
from trainer.config import Config
from trainer.config.redact import REDACTED, redact
from trainer.elastic import (
    EXIT_PREEMPTED,
    StopRequest,
    broadcast_object,
    exit_now,
    gather_objects,
    new_gloo_group,
)
from trainer.engine.goodput import SaveSchedule, TimeLedger
from trainer.engine.runtime import Runtime
from trainer.errors import ConfigError, StoreRefusesWrites
from trainer.metrics import TrainingMetrics
from trainer.storage import describe_store_error, is_store_error

log = logging.getLogger("gentrain")

# Failpoint `GENTRAIN_FAULT_SLOW_SAVE=STEP:SECONDS`: this rank's write of STEP starts SECONDS late (a slow store),
# for the test that the other ranks wait for rank 0's synchronous write inside the save, not inside a step.
FAULT_SLOW_SAVE = "GENTRAIN_FAULT_SLOW_SAVE"


def _fault_slow_save(step: int) -> None:
    at, _, seconds = os.environ.get(FAULT_SLOW_SAVE, "").partition(":")
    if at == str(step):
        log.warning("slowing the save of step %d by %s s (%s is set)", step, seconds, FAULT_SLOW_SAVE)
        time.sleep(float(seconds))


class CheckpointManager:
    """Owns the store and the writer; decides for itself when a step is saved.

    Saves are collective. DDP: every rank's RNG state is gathered and rank 0
    writes. FSDP (sharded): every rank writes its own slices and RNG state,
    reports the files' sizes and digests to rank 0 over a gloo group of its
    own (usable from the writer thread while training runs collectives on
    the default group), and rank 0 commits the manifest only once every rank
    reported success. Both run in the background with `checkpoint.async`. A failed save never
    stops training: it is counted, logged, and the next save retries; only
    the final save raises (so the job is retried rather than losing it).

    With `checkpoint.memory` every rank also hands its piece of every `checkpoint.memory_every_steps`-th
    step to the memory tier (trainer.checkpoint.memory), always in the background, and `resume` tries
    that tier's newest complete step first when it is newer than the durable tier's newest.

    It also owns the run's claim on its root (docs/checkpoints.md, "Runs, timelines and the lease"):
    rank 0 takes the root's lease before anything else (`checkpoint.lease`) and every manifest records
    the run and the timeline that wrote it (`Timeline`), so a save replaces what another run or an
    abandoned timeline left at its step.
    """

    def __init__(self, cfg: Config, runtime: Runtime, metrics: TrainingMetrics):
        c = cfg.checkpoint
        self.cfg = cfg
        self.env, self.sharded = runtime.env, runtime.sharded
        self.metrics = metrics
        self.store = CheckpointStore(cfg.checkpoint_url, c.storage_options, c.keep, c.keep_every_steps)
        self.store.prune_in_background = True  # the training thread does not wait for deletes
        self.group = new_gloo_group(cfg.elastic.collective_timeout_seconds) if self.sharded else None
        self.lease = self._take_lease(cfg)
        self.resuming = self._decide_resume()
        if self.sharded:
            write = functools.partial(
                write_sharded_step,
                self.store,
                rank=self.env.rank,
                world_size=self.env.world_size,
                group=self.group,
            )
            self.writer = Checkpointer(
                self.store,
                c.async_,
                on_done=self._on_committed,
                write=write,
                on_copy_failure=lambda step, meta, e: write(step, {}, meta, failed=repr(e)),
            )
        else:
            self.writer = Checkpointer(self.store, c.async_, on_done=self._on_committed) if self.env.is_main else None
        self.memory, self.memory_writer = self._memory_tier(cfg, runtime, metrics)
        # When each tier saves: fixed intervals, or `auto` ones from the costs measured here (trainer.engine.goodput).
        self.schedule = SaveSchedule(
            c.every_steps,
            c.memory_every_steps,
            self.memory is not None,
            c.max_interval_minutes,
            cfg.elastic.mtbf_hours,
            self.env.world_size,
            self.env.is_main,
        )
        self.ledger: TimeLedger | None = None  # the loop's: fence waits inside a step are checkpoint stall
        self._tier_stall = {"durable": 0.0, "memory": 0.0}  # this save's stall per tier, until its fence
        self.memory_failures = 0
        self._memory_resumed: CheckpointInfo | None = None
        self.resumed_tier: str | None = None
        self.failures = 0
        self.committed_step: int | None = None  # rank 0: the newest step this process committed
        self.saved_step: int | None = None  # every rank: the newest step this process began to save (any tier)
        self._stall: float | None = None  # an async save's stall so far; its fence adds the rest
        self.resumed_from: str | None = None
        self.steps_reached: int | None = None  # the newest step completed before this process started (memory tier)
        self._memory_meta: dict[str, Any] | None = None
        self.progress: Stateful | None = None
        self.parts: Mapping[str, Stateful] = {}
        self.frozen: Mapping[str, FrozenRecord] = {}
        self.inputs: Mapping[str, InputRecord] = {}

    def _memory_tier(
        self, cfg: Config, runtime: Runtime, metrics: TrainingMetrics
    ) -> tuple[MemoryTier | None, Checkpointer | None]:
        """The memory tier and its writer (always in the background), or (None, None) when it is off or
        its folder cannot be made (a warning: training goes on with the durable tier alone). Collective."""
        c = cfg.checkpoint
        if not c.memory:
            return None, None
        root = memory_root(c.memory_dir, cfg.checkpoint_url)
        usable = False
        try:
            make_root(root)  # never a link, nor anyone else's folder (see trainer.checkpoint.memory)
            usable = os.access(root, os.W_OK)
        except OSError as e:
            log.warning("checkpoint.memory: cannot use %s (%s); continuing with the durable tier only", root, e)
        if not all(gather_objects(usable)):  # every rank on, or every rank off: saves are collective
            if usable:
                log.warning("checkpoint.memory is off: another node cannot use its checkpoint.memory_dir")
            return None, None
        tier = MemoryTier(
            root, runtime.env, runtime.sharded, cfg.elastic.collective_timeout_seconds, cfg.checkpoint_url
        )
        if runtime.env.is_main:
            log.info("%s", tier.describe())

        writer = Checkpointer(
            tier.store,
            True,
            write=tier.write,
            on_copy_failure=lambda step, meta, e: tier.write(step, {}, meta, failed=repr(e)),
        )
        return tier, writer

    def attach(
        self,
        progress: Stateful,
        parts: Mapping[str, Stateful],
        frozen: Mapping[str, FrozenRecord],
        inputs: Mapping[str, InputRecord] | None = None,
    ) -> None:
        """The state a checkpoint holds: progress, trainable parts, frozen parts' source records, and the
        task's other inputs (pretrained folders, text encoder: URL and digest, see Task.inputs).

        The frozen records are kept as they are written (trainer.json, manifest): credentials in their
        URLs redacted. A resume compares them by digest, which redaction leaves alone.

        The parts are built with `fence` as theirs (see build_parts): they wait on it before they change
        their weights, optimizer state or EMA, so a background save can copy them while the next
        forward and backward run."""
        self.progress, self.parts = progress, parts
        self.frozen = {name: FrozenRecord.model_validate(redact(r.model_dump())) for name, r in frozen.items()}
        self.inputs = dict(inputs or {})

    # ---------------------------------------------------------------- resume

    def pinned_frozen_sources(self, source_urls: Mapping[str, str]) -> dict[str, FrozenRecord] | None:
        """Frozen-part records of the checkpoint a resume would start from (None on a fresh start).

        A record's URL is stored with its credentials redacted; where the part's URL in this run's
        config (`source_urls`) names the same scheme and host, its credentials are put back, so the
        pinned step can still be opened when the source run has moved on."""
        if not self.resuming:
            return None
        records = None
        if self.env.is_main:
            info = self.store.latest_valid()
            if info is not None:
                try:
                    records = read_frozen_records(self.store, info)
                except CheckpointCorrupt as e:
                    log.warning("checkpoint %s: %s", info.url, e)
        records = broadcast_object(records)
        if records is None:
            return None
        return {name: _with_credentials(record, source_urls.get(name)) for name, record in records.items()}

    def resume(self) -> str | None:
        """Load the newest checkpoint every rank can load (digests, structure and fit checked).

        Rank 0 walks the committed candidates lazily, newest first, and names one at a time; every rank
        reads its share of it (all of it under DDP, its slices under FSDP) and checks it against the
        live parts, rank 0 verifies the files no rank read, and only if all of that passed on every rank
        is it applied, everywhere at once. Otherwise nothing is applied and the previous one is tried.
        """
        if not self.resuming:
            if self.memory is not None:
                self.memory.clear()
            self._start_timeline(None)
            return None
        if self.memory is not None:
            resumed = self._resume_from_memory()
            if resumed is not None:
                self._start_timeline(self._memory_resumed, origin=False)
                return resumed
        candidates = iter(self.store.valid_candidates()) if self.env.is_main else None
        first = True
        while True:
            info = next(candidates, None) if candidates is not None else None
            inputs = self.store.view(info).inputs if info is not None and first else None
            step, recorded = broadcast_object((info.step if info is not None else None, inputs))
            if step is None:
                self._start_timeline(None)
                return None
            if first:  # every rank raises together (exit 2) when a pinned input (the text encoder) changed
                check_pinned_inputs(recorded, self.inputs, f"the run at {self.store.url}")
                first = False
            info = self.store.check(step)
            errors = self._load_everywhere(info)
            if not errors:
                self.resumed_from = self.store.url_for(step)
                self.resumed_tier = "durable"
                self._start_timeline(info)
                return self.resumed_from
            if self.env.is_main:
                log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", info.url, "; ".join(errors))

    def steps_lost(self, step: int) -> int | None:
        """Steps completed before this process started that it trains again (known with the memory tier)."""
        return max(0, self.steps_reached - step) if self.steps_reached is not None else None

    def _resume_from_memory(self) -> str | None:
        """Collective: load the newest step complete in the memory tier if it is newer than the durable
        tier's newest; None if there is none (then the durable tier decides, as without a memory tier).

        One all-gather tells every rank which pieces each node holds; each node then fetches the pieces
        it lacks from a node that holds them, commits the step in its own folder, and the step is loaded
        and checked like a durable checkpoint. A step that fails any of that is dropped, the next tried."""
        tier = self.memory
        assert tier is not None
        durable, belongs = None, None
        if self.env.is_main:
            newest = self.store.latest_valid()
            durable = newest.step if newest is not None else None
            belongs = self._root_owner(newest)
        report = (
            tier.inventory() if tier.is_leader else None,
            tier.reached() if tier.is_leader else None,
            self.env.rank,
        )
        # A worker-group restart of this torchrun job, as any rank's agent counts it: rank 0 may be on a
        # replacement node whose agent counts from 0 while a survivor's agent has restarted (then the root
        # holding no checkpoint yet is this job's, not a new one's).
        restarted = self.env.restart_count > 0 and self.env.run_id not in ("", "local")
        gathered = gather_objects((report, durable, belongs, restarted))
        durable, belongs = gathered[0][1], gathered[0][2]
        if belongs == ("none", "") and any(g[3] for g in gathered):
            belongs = ("job", self.env.run_id)
        if belongs == ("none", ""):  # the root holds no run: whatever the memory tier holds is another's
            if any(r[0] for r, _, _, _ in gathered):
                self._stale_memory("the checkpoint root holds no run (a new root, or one deleted to start over)")
            return None
        plan = agree([r for r, _, _, _ in gathered], durable)
        self.steps_reached = plan.reached
        leaders = [n[0] for n in tier.topology.nodes]
        for step in plan.candidates:
            problems = []
            try:
                for owner in plan.owners[step]:
                    holders = plan.holders[step][owner]
                    for dst in leaders:
                        if dst not in holders:
                            tier.fetch(step, owner, holders[0], dst)
                if tier.is_leader:
                    tier.commit(step, plan.owners[step])
            except (CheckpointError, OSError, RuntimeError) as e:
                problems.append(f"rank {self.env.rank}: {type(e).__name__}: {e}")
            problems = [p for ps in gather_objects(problems) for p in ps]
            if not problems:
                run = tier.read_piece(step, 0).manifest_fields  # owner 0's: what its manifest will say
                assert run is not None  # parse_piece refuses an owner 0 piece without it
                # belongs: ("run" | "job", the value the root's run has), a field of the manifest
                found = getattr(run, belongs[0], None) if belongs is not None else None
                if belongs is not None and found != belongs[1]:  # every rank reads the same piece
                    self.steps_reached = None
                    field, want = belongs
                    self._stale_memory(f"its step {step} is of {field} {found}, the root's {want}")
                    return None
                check_pinned_inputs(run.inputs, self.inputs, f"the memory tier at {tier.root}")
                problems = self._load_everywhere(tier.store.check(step), tier.store)
            if not problems:
                tier.forget_after(step)
                self._memory_resumed = tier.store.check(step)
                self.resumed_from = f"memory:{tier.store.url_for(step)}"
                self.resumed_tier = "memory"
                return self.resumed_from
            if self.env.is_main:
                log.warning(
                    "memory tier: step %d cannot be loaded (%s); trying an older one", step, "; ".join(problems)
                )
            tier.drop(step)
        tier.forget_after(durable)
        return None

    def _root_owner(self, newest: CheckpointInfo | None) -> tuple[str, str] | None:
        """Rank 0: what memory-tier snapshots must belong to for a resume from them, as (manifest field,
        value): the run of the root's newest checkpoint; with none, the run the lease a crashed holder left
        named (this process took it over), or this torchrun job in a worker-group restart of it; ("none", "")
        when the root holds no run (a new root, or one deleted to start over); None: not known (a checkpoint
        from before runs were recorded), no check."""
        if newest is not None:
            run = self.store.view(newest).run
            return ("run", run) if run else None
        if self.lease is not None and self.lease.previous_run:
            return ("run", self.lease.previous_run)
        if self.env.restart_count > 0 and self.env.run_id not in ("", "local"):
            return ("job", self.env.run_id)
        return ("none", "")

    def _stale_memory(self, why: str) -> None:
        """Collective: the memory tier holds another run's snapshots; forget them (each node's leader)."""
        assert self.memory is not None
        if self.env.is_main:
            log.warning(
                "memory tier %s: not resuming from it, its snapshots are not of the run in %s (%s); clearing them",
                self.memory.root,
                self.store.url,
                why,
            )
        self.memory.clear()

    def _load_everywhere(self, info: CheckpointInfo, store: CheckpointStore | None = None) -> list[str]:
        """Collective: read and check `info` on every rank, apply it only if every rank and the check of
        the files nobody read agree; the problems found (none: applied on every rank)."""
        store = self.store if store is None else store
        error, loaded = None, None
        try:
            loaded = read_state(store, info, self.progress, self.parts, self.env.rank)
            # By digest: the URL may differ (stored redacted, or the source run moved on with the same weights).
            recorded = {k: redact(v.model_dump()) for k, v in loaded.frozen.items()}
            now = {k: v.model_dump() for k, v in self.frozen.items()}
            if {k: v.digest for k, v in loaded.frozen.items()} != {k: v.digest for k, v in self.frozen.items()}:
                raise CheckpointCorrupt(f"its frozen parts {recorded} differ from the ones loaded now {now}")
        except ConfigError as e:  # the config, not the checkpoint, is wrong: an older one would not help
            error = ("config", str(e))
        except CheckpointError as e:
            error = ("corrupt", f"rank {self.env.rank}: {e}")
        reports = gather_objects((error, sorted(store.files_verified(info))))
        refused = [e[1] for e, _ in reports if e and e[0] == "config"]
        if refused:
            raise ConfigError(refused[0])  # on every rank together (exit 2)
        problems = [e[1] for e, _ in reports if e]
        if not problems and self.env.is_main:
            read_somewhere = set().union(*(set(names) for _, names in reports))
            problems = store.verify(info, digests_checked=read_somewhere)
        problems = broadcast_object(problems)
        if not problems:
            loaded.apply()
        return problems

    # ---------------------------------------------------------------- save

    @property
    def every_steps(self) -> int:
        """The durable interval now (`checkpoint.every_steps`, or the one `auto` chose)."""
        return self.schedule.every_steps

    @property
    def memory_every_steps(self) -> int:
        return self.schedule.memory_every_steps

    def durable_due(self, step: int) -> bool:
        """Whether `maybe_save(step)` writes a durable checkpoint (the same answer on every rank)."""
        return self.schedule.durable_due(step)

    def saves_at(self, step: int) -> bool:
        """Whether `maybe_save(step)` writes anything (either tier)."""
        return self.schedule.memory_due(step) or self.schedule.durable_due(step)

    def maybe_save(self, step: int) -> None:
        if self.memory is not None:
            self.memory.mark_reached(step)  # every step: the steps a restart loses are counted from it
        if self.memory is not None and self.schedule.memory_due(step):
            self.save_to_memory(step)
            self.schedule.saved(step, "memory")
        if self.schedule.durable_due(step):
            self.save(step)
            self.schedule.saved(step, "durable")

    def save_to_memory(self, step: int) -> None:
        """Collective: this rank's piece of `step` into the memory tier, in the background (see trainer.checkpoint.memory)."""
        assert self.memory is not None and self.memory_writer is not None
        self.saved_step = max(step, self.saved_step or 0)
        t0 = time.perf_counter()
        # Every node writes the whole state from its own replica (its leader), unlike the durable tier.
        files, index, owner = self._snapshot(writes_whole=self.memory.is_leader)
        if self._memory_meta is None:
            self._memory_meta = self._meta()
        meta = {**(self._memory_meta if owner == 0 else {}), OWNER: owner, INDEX: index}
        try:
            self.memory_writer.save(step, files, meta, stable=updated_only_in_steps(self.parts))
        except Exception as e:  # the previous snapshot's failure, raised by its wait: the next one retries
            self._count_memory_failure(e)
        self._stall = (self._stall or 0.0) + time.perf_counter() - t0
        self._tier_stall["memory"] += time.perf_counter() - t0

    def _snapshot(self, writes_whole: bool) -> tuple[dict[str, Any], dict[str, Any] | None, int | None]:
        """Collective: this rank's files of the state now, for either tier, as (files, shard index, owner).

        Sharded (FSDP): every rank's own slices and their index; the owner is its rank. Otherwise every
        rank's RNG state is gathered, and a rank that `writes_whole` (rank 0 for the durable tier, each
        node's leader for the memory tier) gets the whole state (owner 0); the others nothing (owner None)."""
        if self.sharded:
            files, index = sharded_snapshot_files(self.progress, self.parts, self.frozen, self.env.rank)
            return files, index, self.env.rank
        rank_states = gather_objects(capture_rank_state())
        if not writes_whole:
            return {}, None, None
        return snapshot_files(self.progress, self.parts, rank_states, self.frozen), None, 0

    def _count_memory_failure(self, err: BaseException) -> None:
        self.memory_failures += 1
        self.metrics.on_checkpoint_failure()
        if self.memory_failures == 1 or self.memory_failures % 100 == 0:
            log.error(
                "memory-tier snapshot failed (%d so far; training continues, the durable tier is unaffected, the "
                "next snapshot retries): %s",
                self.memory_failures,
                err,
            )

    def _meta(self) -> dict[str, Any]:
        """What the manifest says about the run, credentials redacted: a checkpoint root is read by more
        people than the keys that wrote it, and a resume takes its storage options from its own config."""
        meta = {
            "world_size": self.env.world_size,
            "parallel": self.cfg.train.parallel,
            "gentrain_version": __version__,
            "torch_version": torch.__version__,
            "task": self.cfg.task,
            "config": self.cfg.to_dict(),
            "frozen": {name: record.model_dump() for name, record in self.frozen.items()},
            "inputs": {name: record.dump() for name, record in self.inputs.items()},
            # Who wrote it, for both tiers: the one place the timeline's fields are merged (the store commits
            # what it is given; the memory tier's pieces carry them before any commit).
            **(self.store.timeline.fields() if self.store.timeline is not None else {}),
        }
        # LoRA parts whose files hold the adapters only (Part.saved_keys), each with the `inputs` entry that
        # pins its frozen base (the pretrained folder every start rebuilds it from; see CheckpointView.adapter_only).
        adapters = {n: f"{n}.pretrained" for n, p in self.parts.items() if getattr(p, "saved_keys", None) is not None}
        if adapters:
            meta["adapter_only"] = adapters
        return redact(meta)

    def save(self, step: int, sync: bool = False, final: bool = False) -> bool:
        """Collective: every rank contributes its own state. False if it failed; LeaseLost (exit 2, every
        rank) once another trainer took the root over."""
        self._stop_if_lease_lost()
        self.saved_step = max(step, self.saved_step or 0)
        t0 = time.perf_counter()
        files, index, _ = self._snapshot(writes_whole=self.env.is_main)
        if self.sharded:
            meta = {**self._meta(), LOCAL_INDEX: index}
        else:
            # Rank 0 writes alone. A synchronous write is waited for here, on every rank (`_rank0_wrote`):
            # otherwise the others would wait for it inside the next step's all-reduce, where the step
            # watchdog (elastic.step_timeout_seconds) takes a save longer than that for a hung step, and
            # the time ledger counts it as training. Here it is checkpoint stall, bounded by
            # elastic.phase_timeout_seconds like every collective outside a step.
            waits = self.env.world_size > 1 and (sync or not self.cfg.checkpoint.async_)
            if not self.env.is_main:
                ok = self._rank0_wrote(None) if waits else True
                self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
                self.schedule.on_cost("durable", time.perf_counter() - t0)
                return bool(ok)
            meta = self._meta()
            if waits:
                try:
                    ok = self._write(step, files, meta, sync, final, t0)
                except BaseException:  # the lease lost, a final save that failed: the others go on, then stop
                    self._rank0_wrote(False)
                    raise
                return self._rank0_wrote(ok)
        return self._write(step, files, meta, sync, final, t0)

    @staticmethod
    def _rank0_wrote(ok: bool | None) -> bool:
        """Collective: rank 0's verdict on its synchronous write (True: committed), on every rank."""
        return bool(broadcast_object(ok))

    def _write(
        self, step: int, files: Mapping[str, Any], meta: Mapping[str, Any], sync: bool, final: bool, t0: float
    ) -> bool:
        """This rank's write of `files` (rank 0's whole checkpoint, or a sharded save's own files)."""
        background = self.writer.async_save and not sync
        _fault_slow_save(step)
        try:
            # The writer logs the commit and reports it to the metrics itself. A background save copies the
            # parts' weights, optimizer state and EMA while the next step runs (see `fence`).
            self.writer.save(
                step, files, meta, sync=sync, stable=updated_only_in_steps(self.parts) if background else None
            )
        except LeaseLost:
            raise
        except Exception as e:  # storage outage, quota, credentials: training goes on
            if final:  # must not be lost silently: the run stops, in one line, its last good checkpoint kept
                self.failures += 1
                self.metrics.on_checkpoint_failure()
                kept = self.store.url_for(self.committed_step) if self.committed_step is not None else None
                raise final_save_error(step, self.store.url, e, kept) from None
            self._count_failure(e)
            return False
        if background:
            self._stall = (self._stall or 0.0) + time.perf_counter() - t0  # the fence adds what it waits
            self._tier_stall["durable"] += time.perf_counter() - t0
        else:
            self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
            self.schedule.on_cost("durable", time.perf_counter() - t0)
        return True

    def fence(self) -> None:
        """Wait until a background save has copied the parts' state; every part calls this before it
        changes its weights, optimizer state or EMA. A failed copy is counted like a failed save (that
        checkpoint is not written; training goes on and the next save retries)."""
        waited = {"memory": 0.0, "durable": 0.0}
        if self.memory_writer is not None:
            try:
                waited["memory"] += self.memory_writer.fence()
            except SnapshotError as e:
                self._count_memory_failure(e)
        if self.writer is not None:
            try:
                waited["durable"] += self.writer.fence()
            except SnapshotError as e:
                self._count_failure(e)
        if self.ledger is not None:  # inside a step: these seconds were the save's, not the step's
            self.ledger.take("checkpoint_stall", waited["memory"] + waited["durable"])
        if self._stall is not None:
            self.metrics.on_checkpoint_stall(self._stall + waited["memory"] + waited["durable"])
            self._stall = None
            for tier, stall in self._tier_stall.items():
                if stall:  # one save's (or snapshot's) whole cost to the training thread, for `auto` intervals
                    self.schedule.on_cost(tier, stall + waited[tier])
            self._tier_stall = {"durable": 0.0, "memory": 0.0}

    def _on_committed(self, result: SaveResult) -> None:
        """A save this process committed (from the writer, its thread when async)."""
        self.committed_step = max(result.info.step, self.committed_step or 0)
        self.metrics.on_checkpoint_done(result)

    def _count_failure(self, err: BaseException) -> None:
        self.failures += 1
        self.metrics.on_checkpoint_failure()
        log.error(
            "checkpoint save failed (%d so far; training continues, the last committed checkpoint stays valid, "
            "the next save retries): %s",
            self.failures,
            err,
        )

    def report_background_failure(self) -> None:
        if self.memory_writer is not None:
            err = self.memory_writer.take_failure()
            if err is not None:
                self._count_memory_failure(err)
        if self.writer is not None:
            err = self.writer.take_failure()
            if err is not None:
                self._count_failure(err)

    def emergency_save(self, step: int, stop: StopRequest) -> int:
        """All ranks agreed to stop: write a checkpoint within the grace period; returns 143.

        An async save still in flight goes first (it may commit in time: then it is the newest valid
        checkpoint if this one does not make it). Both run on a helper thread so the wait ends at the
        grace deadline whatever the store does; past it this process exits 143 at once, and a save cut
        short has no manifest, so the newest committed checkpoint stays the newest valid one.
        """
        left = stop.seconds_left()
        log.warning("stop requested: writing an emergency checkpoint at step %d (%.1fs of grace left)", step, left)
        self.metrics.on_preemption()
        done = threading.Event()
        outcome: dict[str, Any] = {"waiting_for": "the emergency checkpoint"}

        def work() -> None:
            try:
                if self.writer is not None and self.writer.writing():
                    outcome["waiting_for"] = "the async save in flight before it"
                    self.writer.wait()
                    outcome["waiting_for"] = "the emergency checkpoint"
                outcome["ok"] = self.save(step, sync=True)
            except BaseException as e:  # reported below; exit code stays 143
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="gentrain-emergency-save", daemon=True).start()
        if not done.wait(timeout=max(0.0, stop.seconds_left())):
            log.error(
                "emergency checkpoint did not finish within elastic.grace_seconds=%g (still writing %s); "
                "exiting 143, the newest committed checkpoint stays valid",
                stop.grace_seconds,
                outcome["waiting_for"],
            )
            exit_now(EXIT_PREEMPTED)
        if outcome.get("error") or not outcome.get("ok"):
            log.error("emergency checkpoint failed: %s; the previous checkpoint stays valid", outcome.get("error"))
        else:
            log.warning("emergency checkpoint written at step %d; exiting 143", step)
        return EXIT_PREEMPTED

    def close(self) -> None:
        if self.memory_writer is not None:
            self.memory_writer.close()
        if self.writer is not None:
            self.writer.close()
        self.report_background_failure()
        if self.lease is not None:
            self.lease.release()  # a clean exit, or the end of an emergency save: a successor need not wait

    def release_lease(self) -> None:
        """Give the root's lease back now (a run refused while it was being built)."""
        if self.lease is not None:
            self.lease.release()

    # ---------------------------------------------------------------- ownership

    def _take_lease(self, cfg: Config) -> Lease | None:
        """Collective: rank 0 takes the root's lease (waiting up to a holder's lease_seconds to see whether it
        lapses); every rank raises LeaseError together if another trainer holds it. None with checkpoint.lease
        off."""
        c = cfg.checkpoint
        if not c.lease:
            if self.env.is_main and (who := present_holder(self.store.fs, self.store.root)) is not None:
                log.warning(
                    "checkpoint.lease=false, but %s has a lease held by %s: this trainer does not check it, so "
                    "if that trainer is running both write this run and one's work is lost. Stop one of them, "
                    "or leave checkpoint.lease on",
                    self.store.url,
                    who,
                )
            return None
        if c.lease_seconds * 2 + 60 > cfg.elastic.collective_timeout_seconds and self.env.world_size > 1:
            raise ConfigError(
                f"checkpoint.lease_seconds={c.lease_seconds:g} is too long for elastic.collective_timeout_seconds="
                f"{cfg.elastic.collective_timeout_seconds:g}: the other ranks wait for rank 0 to take the lease for "
                "up to twice lease_seconds; make collective_timeout_seconds at least 2 * lease_seconds + 60"
            )
        lease, refusal = None, None
        if self.env.is_main:
            holder = Holder.me(self.env.run_id, self.env.restart_count)
            lease = Lease(self.store.fs, self.store.root, self.store.url, c.lease_seconds, holder)
            try:
                lease.acquire()
            except LeaseError as e:
                refusal = str(e)
            except Exception as e:  # the store itself: an outage, not a config error (exit 1: retried)
                if not is_store_error(e):  # botocore's and aiohttp's are not all OSErrors
                    raise
                refusal = (
                    f"OSError: cannot take the lease on {self.store.url} ({describe_store_error(e)}); the store "
                    "may be unreachable: the job's restart tries again"
                )
        refusal = broadcast_object(refusal)  # every rank waits for rank 0's answer, then raises together
        if refusal is not None and refusal.startswith("OSError: "):
            raise CheckpointError(refusal.removeprefix("OSError: "))
        if refusal is not None:
            raise LeaseError(refusal)
        if lease is not None:
            self.store.check_lease = lease.check
            atexit.register(lease.release)  # an exit on an error: the next launch need not wait for it to lapse
        return lease

    def _stop_if_lease_lost(self) -> None:
        """Collective: LeaseLost on every rank once rank 0 learned that another trainer took the root over."""
        lost = self.lease.lost if self.lease is not None else None
        lost = broadcast_object(lost) if self.env.world_size > 1 else lost
        if lost is not None:
            raise LeaseLost(lost)

    def _decide_resume(self) -> bool:
        """Collective: whether this process resumes. `checkpoint.resume=false` over a root that holds another
        run's checkpoints exits 2 (gentrain never mixes two runs in one root), except in a worker-group restart
        of the job that wrote them: that job goes on (else a torchrun restart would start over, or be refused)."""
        if self.cfg.checkpoint.resume:
            return True
        verdict: tuple[bool, str | None] = (False, None)
        if self.env.is_main:
            newest = next(iter(self.store.valid_candidates()), None)
            if newest is not None:
                job = self.store.view(newest).job
                if self.env.restart_count > 0 and self.env.run_id not in ("", "local") and job == self.env.run_id:
                    log.warning(
                        "checkpoint.resume=false, but this is restart %d of torchrun job %s, which wrote %s: "
                        "resuming it (only the job's first start starts over)",
                        self.env.restart_count,
                        job,
                        newest.url,
                    )
                    verdict = (True, None)
                else:
                    verdict = (
                        False,
                        f"checkpoint.resume=false, but {self.store.url} holds checkpoints of another run (newest "
                        f"{newest.url}, written by {self.store.view(newest).owner}): gentrain does not write two "
                        "runs into one root. To start over, give this run its own checkpoint.url (or name), or "
                        f"delete {self.store.url}; to continue that run, leave checkpoint.resume=true",
                    )
        resuming, refusal = broadcast_object(verdict)
        if refusal is not None:
            raise ConfigError(refusal)
        return resuming

    def _start_timeline(self, info: CheckpointInfo | None, origin: bool = True) -> None:
        """Collective: mint this process's timeline, carrying the run id of the checkpoint `info` it resumed
        from (a fresh run id when it starts fresh, or from a checkpoint that recorded none)."""
        run = self.store.view(info).run if info is not None else None
        timeline = Timeline(
            run=run or new_owner_id(),
            timeline=new_owner_id(),
            job=self.env.run_id,
            origin=(info.step, info.fingerprint) if info is not None and origin else None,
        )
        self.store.timeline = broadcast_object(timeline)  # rank 0's ids, on every rank
        if self.lease is not None:
            self.lease.name_run(self.store.timeline.run)
        if self.env.is_main:
            log.info(
                "checkpoints of this process: run %s, timeline %s%s",
                self.store.timeline.run,
                self.store.timeline.timeline,
                f" (from step {info.step})" if info is not None else " (fresh start)",
            )


# A store that refuses writes for good: read-only, no permission (also what s3fs and gcsfs raise for a 403), full.
_REFUSED_WRITES = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def final_save_error(step: int, url: str, err: BaseException, kept: str | None) -> Exception:
    """What a failed final save ends the run with, in one line and never a traceback (`kept`: the newest
    checkpoint this process committed, which stays valid).

    A store that refuses writes (`_REFUSED_WRITES`) is `StoreRefusesWrites`, exit 2: a restart would train the
    steps since the last checkpoint again and fail the same way, and torchrun and Kubernetes restart exit 1
    forever (the crash-loop record cannot be written there either). Anything else (an outage, a timeout) is a
    `CheckpointError`, exit 1: the job's restart resumes from the last good checkpoint and tries again."""
    if isinstance(err, ConfigError):  # the lease lost, or a refusal of its own: already says what to do
        return err
    what = f"the final checkpoint (step {step}) could not be written to {url}"
    kept_text = f"{kept} stays valid" if kept else "the newest committed checkpoint stays valid"
    cause, seen = err, 0
    while cause is not None and seen < 8:  # the writer may wrap the store's OSError
        if isinstance(cause, OSError) and (isinstance(cause, PermissionError) or cause.errno in _REFUSED_WRITES):
            return StoreRefusesWrites(
                f"{what}: the store refuses writes ({type(cause).__name__}: {cause}). Retrying cannot help: make "
                "it writable (its permissions, a read-only mount, the bucket's policy or credentials, free "
                f"space), then start the run again; {kept_text} and the run resumes from it"
            )
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return CheckpointError(f"{what} ({type(err).__name__}: {err}); {kept_text} and the job's restart resumes from it")


# scheme://[userinfo@]host at the start of a URL (userinfo as trainer.config.redact finds it).
_ORIGIN = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?:(?P<userinfo>[^/@\s'\"]+)@)?(?P<host>[^/?#@]*)")


def _with_credentials(record: FrozenRecord, source_url: str | None) -> FrozenRecord:
    """`record` with the redacted user info of its URL replaced by `source_url`'s (same scheme and host;
    none if `source_url` has none)."""
    url = record.url
    stored = _ORIGIN.match(url)
    given = _ORIGIN.match(source_url) if source_url else None
    if stored is None or given is None or stored["userinfo"] != REDACTED:
        return record
    if (stored["scheme"], stored["host"]) != (given["scheme"], given["host"]):
        return record
    return record.model_copy(update={"url": given.group(0) + url[stored.end() :]})
