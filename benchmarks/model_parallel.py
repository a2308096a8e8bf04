"""Model parallelism: throughput and activation memory of multi-stage models
(blocks placed with ``poptorch.Block`` and an execution strategy), each
stage a separate partition (``_impl/staging/staged_execution.py``), in one process,
and a 2-stage pipeline over 2 processes.

1. Throughput. An MLP of K blocks (each two Linear + ReLU of width W)
   trained with SGD, D device iterations of G micro-batches of S rows per
   call, in samples/s and as a ratio to the plain PyTorch loop doing the
   same work (D times: G forward/backward passes, then one optimizer step):
   ``poptorch.trainingModel`` of the unannotated model (one captured graph),
   and of the model with one block per stage under ``PipelinedExecution``
   (``ScheduleInterleaved1F1B`` with all K stages in this process),
   ``ShardedExecution`` and ``SerialPhasedExecution`` (one stage per
   phase). Medians of interleaved passes (``timing.interleaved_medians``),
   one pass being one call (D optimizer steps), with one torch thread by
   default (``--threads``). The theoretical bubble of a
   1F1B pipeline of K stages and M = G micro-batches, (K - 1) / (M + K - 1),
   is printed for reference only: in one process the stages share the
   device and run one at a time, so there is no concurrency to lose and no
   bubble to measure (section 3 measures one over two processes).

2. Activation memory. A model of K blocks, each of two residual sub-layers
   with a wide (4 W) hidden layer and several elementwise operations on it,
   trained for one optimizer step (G micro-batches) under each strategy,
   without recomputation checkpoints, with ``poptorch.recomputationCheckpoint``
   on each block's input, and on each block's output. What is measured is
   what autograd keeps for the backward pass, through
   ``torch.autograd.graph.saved_tensors_hooks`` around the call:

   * a saved tensor counts ``numel * element_size`` bytes, once while it is
     saved: a region (same data pointer and size) saved by several
     operations counts once until all of them have released it.
     Parameters (and views of them) are left out: they live anyway.
   * the pack hook returns a small holder object; autograd drops it when the
     backward pass no longer needs the tensor (or the graph is freed), and a
     ``weakref.finalize`` on the holder then takes the bytes off the live
     count. "Saved per micro-batch" is the sum of all bytes counted over
     the step divided by G; "peak live" is the maximum of the live count
     during the step, the measure of what must fit at once.
   * ``torch.utils.checkpoint`` (non-reentrant, which the stages use) saves
     a segment's inputs through these hooks and its inner tensors through
     its own, so a recomputed segment counts only its inputs. The tensors
     recomputed during the backward pass live only while their segment's
     backward runs and are not counted; nor are temporaries (gradients,
     outputs not saved).
   * a stage with checkpoints runs each of its segments under
     ``torch.utils.checkpoint`` (``staging/stages.py``), so only the stage's inputs
     and the checkpointed tensors are kept; the rest is recomputed in the
     backward pass.
   * the single-graph path (``trainingModel`` of an unannotated model)
     traces forward and backward into one graph, so no saved tensors are
     visible at run time and it is not in this table.

   Per phase of ``SerialPhasedExecution``: forward pre- and post-hooks on
   the stage modules (``model._staged._modules``) attribute each newly
   counted tensor to the stage whose forward pass is running; "outside"
   is what the loss scaling between the last stage and the backward pass
   saves. That is what a phase would move off the device under a
   ``Liveness`` other than ``AlwaysLive`` (which has no effect on a CPU).

3. A 2-stage pipeline on 2 CPU processes against the same model in one
   process. An MLP of 2 blocks of L Linear(W, W) + ReLU (``--pipeline-*``
   flags; by default W = 1024, L = 3, S = 128, G = 8, D = 2: a stage's
   forward and backward passes of one micro-batch take about 20 ms, against
   about 1 ms to pass its activations and their gradients between the
   processes), trained with SGD under ``PipelinedExecution``, one torch
   thread per process, as

   (a) one process, ``trainingModel`` of the unannotated model (one
       captured graph);
   (b) one process, the annotated model: its 2 stages one after the other
       (``ScheduleInterleaved1F1B`` with both stages local);
   (c) 2 processes, one stage each (``Schedule1F1B``,
       ``_impl/distributed/pipeline_processes.py``), started by this script
       (``--worker DIR``, with torchrun's variables: ``RANK``,
       ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port).
       Each worker makes two warm-up calls, times ``--pipeline-calls``
       calls and writes its times as JSON to ``DIR``; the slower worker's
       median call is (c)'s time per call (a call ends in collectives of
       both processes).

   A round is ``--pipeline-repeats`` interleaved calls of (a) and (b), then
   one run of the workers; the tables give the median over
   ``--pipeline-rounds`` rounds of each round's median (samples/s of each
   round too, to show the spread). With a core per stage, only the
   schedule steps run concurrently, so (c) can approach twice (b) only as
   far as the stages' work outweighs what runs outside them, which is not
   halved.

   Where a call's time goes (``StageClock``), for (b) and each process of
   (c), in ms per call: the call; the process's CPU time (all its threads);
   the schedule steps (``model._staged._schedule.run`` wrapped, one per
   optimizer step: the G micro-batches' forward and backward passes and
   the transfers between stages, nothing else); within them the stage's
   forward passes (forward pre- and post-hooks on the process's
   ``StageModule``, ``model._staged._modules[stage]``) and backward passes
   (from the module's full backward pre-hook, when the gradient of its
   outputs arrives, to the return of the ``PipelineStage``'s
   ``backward_one_chunk``, when autograd has finished the micro-batch:
   the module's full backward hook cannot end it, as it fires as soon as
   the gradients of the module's positional inputs are ready, which for
   the first stage, whose inputs need none, is at once); and what the call
   spends outside the schedule steps: the input check across the
   processes, the optimizer step (each process updates its stage's weights),
   sharing the last stage's outputs with the other process and, once per
   call, broadcasting each stage's weights and optimizer state.

   The idle fraction is 1 - (forward + backward) / schedule steps. In (c)
   it is the pipeline bubble (the last stage waits for the first
   activation, the first stage for the first gradient; the last stage
   leaves the step once it has sent its last gradient, so its wait while
   the first stage finishes is outside, in the output sharing), plus the
   transfers (gloo over loopback; the schedule waits for each micro-batch's
   sends and receives), the imbalance between the stages (the last one
   runs the classifier and the loss, and computes the gradient of its
   input, which the first stage does not need: its backward pass is the
   longer) and the schedule's own bookkeeping, which (b)'s idle fraction
   measures alone. It is compared with the theoretical 1F1B bubble
   (K - 1) / (M + K - 1) for K = 2 and M = G, which assumes equal stages
   and free transfers. (b) and (c) are timed with these hooks in place
   (microseconds per micro-batch); (a) has none. The last line compares the
   stages' forward + backward time in (c) (both processes) with (b)'s: two
   processes computing at once each run somewhat slower than one alone
   (shared caches and memory bandwidth; about 1.1 times here on an
   otherwise idle machine); well above that, the two processes did not
   each get a core (other load on the machine) and (c) understates the
   pipeline.

Run by hand: ``.venv/bin/python benchmarks/model_parallel.py`` (about 2
minutes on 2 CPU cores, of which section 3 takes most;
``--skip-throughput``, ``--skip-memory``, ``--skip-processes`` leave out a
section). Prints markdown tables.
"""
import argparse
import collections
import copy
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from timing import interleaved_medians

import poptorch


class MLP(torch.nn.Module):
    """K blocks of ``layers`` Linear + ReLU of width W, then a classifier.
    With ``annotate``, block i is ``poptorch.Block("block{i}", ipu_id=i)``."""

    def __init__(self, width: int, blocks: int, layers: int = 2):
        super().__init__()
        self.annotate = False
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[module for _ in range(layers)
                                  for module in (torch.nn.Linear(width, width),
                                                 torch.nn.ReLU())])
            for _ in range(blocks))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x, y):
        for index, block in enumerate(self.blocks):
            if self.annotate:
                with poptorch.Block(f"block{index}", ipu_id=index):
                    x = block(x)
            else:
                x = block(x)
        out = self.head(x)
        return out, torch.nn.functional.cross_entropy(out, y)


class WideBlock(torch.nn.Module):
    """Two residual sub-layers W -> 4 W -> W with elementwise operations on
    the wide hidden layer, so that most saved bytes are 4 W wide."""

    def __init__(self, width: int, sublayers: int = 2, expansion: int = 4):
        super().__init__()
        self.up = torch.nn.ModuleList(
            torch.nn.Linear(width, expansion * width)
            for _ in range(sublayers))
        self.down = torch.nn.ModuleList(
            torch.nn.Linear(expansion * width, width)
            for _ in range(sublayers))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            h = torch.nn.functional.gelu(up(x))
            h = h * torch.sigmoid(h)
            h = torch.tanh(h) * h
            x = x + down(h)
        return x


class WideModel(torch.nn.Module):
    """K annotated WideBlocks; ``checkpoint`` is None, "input" (a
    recomputationCheckpoint on each block's input) or "output" (on each
    block's output)."""

    def __init__(self, width: int, blocks: int,
                 checkpoint: Optional[str] = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.blocks = torch.nn.ModuleList(WideBlock(width)
                                          for _ in range(blocks))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x, y):
        for index, block in enumerate(self.blocks):
            with poptorch.Block(f"block{index}", ipu_id=index):
                if self.checkpoint == "input":
                    x = poptorch.recomputationCheckpoint(x)
                x = block(x)
                if self.checkpoint == "output":
                    x = poptorch.recomputationCheckpoint(x)
        out = self.head(x)
        return out, torch.nn.functional.cross_entropy(out, y)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _strategies(blocks: int) -> Dict[str, object]:
    names = [f"block{i}" for i in range(blocks)]
    return {
        "PipelinedExecution": poptorch.PipelinedExecution(*names),
        "ShardedExecution": poptorch.ShardedExecution(*names),
        "SerialPhasedExecution": poptorch.SerialPhasedExecution(
            *[[name] for name in names]),
    }


def _options(arguments, strategy=None) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(arguments.iterations)
    opts.Training.gradientAccumulation(arguments.accumulation)
    opts.showCompilationProgressBar(False)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


def _data(arguments, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    rows = arguments.iterations * arguments.accumulation * \
        arguments.micro_batch
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, width, generator=generator),
            torch.randint(0, 10, (rows,), generator=generator))


# --- throughput ----------------------------------------------------------

def eager_pass(model: torch.nn.Module, x, y, arguments) -> Callable:
    """The plain loop: D times, G micro-batch backward passes (the loss
    divided by G, as the Mean reduction does) then one SGD step."""
    optimizer = _optimizer(model)
    batches = list(zip(x.split(arguments.micro_batch),
                       y.split(arguments.micro_batch)))
    accumulation = arguments.accumulation

    def one_pass():
        for step in range(arguments.iterations):
            optimizer.zero_grad()
            for xb, yb in batches[step * accumulation:
                                  (step + 1) * accumulation]:
                _, loss = model(xb, yb)
                (loss / accumulation).backward()
            optimizer.step()

    return one_pass


def poptorch_pass(model: torch.nn.Module, x, y, arguments,
                  strategy=None) -> Callable:
    """One call of a training model: D optimizer steps over the data."""
    model.annotate = strategy is not None
    training = poptorch.trainingModel(model, _options(arguments, strategy),
                                      _optimizer(model))
    training.compile(x, y)
    return lambda: training(x, y)


def throughput_table(arguments) -> None:
    blocks, accumulation = arguments.blocks, arguments.accumulation
    rows = arguments.iterations * arguments.accumulation * \
        arguments.micro_batch
    print(f"\n### Training throughput: MLP of K = {blocks} blocks, width "
          f"{arguments.width}, S = {arguments.micro_batch}, G = "
          f"{arguments.accumulation}, D = {arguments.iterations} ({rows} "
          f"samples per call), median of {arguments.repeats} interleaved "
          "calls\n")
    torch.manual_seed(0)
    base = MLP(arguments.width, blocks)
    x, y = _data(arguments, arguments.width)
    names = ["plain PyTorch loop", "trainingModel, unannotated (one graph)"]
    passes = [eager_pass(copy.deepcopy(base), x, y, arguments),
              poptorch_pass(copy.deepcopy(base), x, y, arguments)]
    for name, strategy in _strategies(blocks).items():
        names.append(f"{name}, {blocks} stages")
        passes.append(poptorch_pass(copy.deepcopy(base), x, y, arguments,
                                    strategy))
    seconds = interleaved_medians(passes, arguments.repeats)
    print("| run | samples/s | ratio to the plain loop |")
    print("|---|---|---|")
    for name, per_call in zip(names, seconds):
        print(f"| {name} | {rows / per_call:,.0f} | "
              f"{seconds[0] / per_call:.2f} |")
    bubble = (blocks - 1) / (accumulation + blocks - 1)
    print(f"\nPipeline of K = {blocks} stages over M = G = {accumulation} "
          f"micro-batches: theoretical 1F1B bubble (K - 1) / (M + K - 1) = "
          f"{bubble:.0%} of each stage's time. Here all the stages run in "
          "one process and share its device: they never run concurrently, "
          "so there is nothing to overlap and no bubble to measure (see "
          "the 2-process pipeline below).")


# --- memory --------------------------------------------------------------

class _Held:
    """What the pack hook gives autograd: the saved tensor, in an object
    whose lifetime is that of the saved slot."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedBytes:
    """Bytes of the tensors autograd saves while ``hooks()`` is active,
    attributed to the running stage (``watch``)."""

    OUTSIDE = "outside"

    def __init__(self):
        self.live: Dict[Tuple[int, int], List[int]] = {}
        self.live_bytes = 0
        self.peak = 0
        self.total = 0
        self.by_stage: Dict[object, int] = collections.Counter()
        self.stage: object = self.OUTSIDE
        self.excluded: set = set()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                        self._unpack)

    def watch(self, modules: List[torch.nn.Module]) -> None:
        """Attribute what each module's forward pass saves to its index;
        refresh the parameter storages to leave out as it starts (the
        stages' parameters are rebound at every optimizer step)."""
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(
                lambda mod, args, kwargs, index=index:
                self._enter(index, modules), with_kwargs=True)
            module.register_forward_hook(
                lambda mod, args, output: self._leave())

    def _enter(self, index: int, modules) -> None:
        self.stage = index
        self.excluded = {p.untyped_storage().data_ptr()
                         for module in modules for p in module.parameters()}

    def _leave(self) -> None:
        self.stage = self.OUTSIDE

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self.excluded:
            return tensor
        size = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), size)
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, size]
            self.total += size
            self.live_bytes += size
            self.peak = max(self.peak, self.live_bytes)
            self.by_stage[self.stage] += size
        entry[0] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: Tuple[int, int]) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self.live[key]

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held


def measure_step(arguments, checkpoint: Optional[str],
                 strategy) -> SavedBytes:
    """What one optimizer step (D = 1, G micro-batches) of the wide model
    saves for its backward passes (after a first step, which compiles)."""
    torch.manual_seed(0)
    model = WideModel(arguments.memory_width, arguments.blocks, checkpoint)
    opts = _options(arguments, strategy).deviceIterations(1)
    training = poptorch.trainingModel(model, opts, _optimizer(model))
    step = copy.copy(arguments)
    step.iterations = 1
    x, y = _data(step, arguments.memory_width)
    training(x, y)
    counter = SavedBytes()
    counter.watch(training._staged._modules)
    with counter.hooks():
        training(x, y)
    if counter.live_bytes:
        print(f"(warning: {counter.live_bytes} saved bytes still held after "
              "the step)")
    return counter


def _kib(count: float) -> str:
    return f"{count / 1024:,.0f}"


def memory_tables(arguments) -> None:
    width, blocks = arguments.memory_width, arguments.blocks
    accumulation = arguments.accumulation
    print(f"\n### Saved for the backward pass: {blocks} blocks of 2 residual "
          f"sub-layers {width} -> {4 * width} -> {width}, S = "
          f"{arguments.micro_batch}, one optimizer step of G = {accumulation} "
          "micro-batches, KiB\n")
    variants = {"none": None, "each block's input": "input",
                "each block's output": "output"}
    results = {}
    print("| strategy | recomputationCheckpoint | saved per micro-batch | "
          "peak live during the step |")
    print("|---|---|---|---|")
    for name, strategy in _strategies(blocks).items():
        for label, checkpoint in variants.items():
            counter = measure_step(arguments, checkpoint, strategy)
            results[name, checkpoint] = counter
            print(f"| {name} | {label} | "
                  f"{_kib(counter.total / accumulation)} | "
                  f"{_kib(counter.peak)} |")
    print("\nWith checkpoints, a stage keeps only its inputs and the "
          "checkpointed tensors; the rest is recomputed in the backward "
          "pass. With all the stages in one process, the 1F1B "
          "schedule starts a micro-batch's backward pass as soon as its "
          "forward pass leaves the last stage, so it holds about one "
          "micro-batch's activations at a time, like the sequential "
          "strategies.")
    print("\n### SerialPhasedExecution: saved during each phase's forward "
          "pass, KiB per micro-batch\n")
    header = " | ".join(f"phase {i}" for i in range(blocks))
    print(f"| recomputationCheckpoint | {header} | outside the phases |")
    print("|---|" + "---|" * (blocks + 1))
    for label, checkpoint in variants.items():
        counter = results["SerialPhasedExecution", checkpoint]
        cells = " | ".join(_kib(counter.by_stage[i] / accumulation)
                           for i in range(blocks))
        print(f"| {label} | {cells} | "
              f"{_kib(counter.by_stage[SavedBytes.OUTSIDE] / accumulation)}"
              " |")


# --- two processes -------------------------------------------------------

PIPELINE = ("block0", "block1")
CLOCKED = ("call", "cpu", "window", "forward", "backward", "forwards",
           "backwards")


def _pipeline_arguments(arguments) -> argparse.Namespace:
    """The section's sizes under the names ``_options``, ``_data`` and
    ``poptorch_pass`` read."""
    return argparse.Namespace(iterations=arguments.pipeline_iterations,
                              accumulation=arguments.pipeline_accumulation,
                              micro_batch=arguments.pipeline_micro_batch)


def _pipeline_model(arguments) -> MLP:
    torch.manual_seed(0)
    return MLP(arguments.pipeline_width, 2, arguments.pipeline_layers)


def _staged_training(arguments, model: MLP):
    """The annotated model under ``PipelinedExecution`` after a first call
    (which compiles it and sets up the schedule: a ``StageClock`` must come
    after it, as the pipeline's shape inference writes in place to the
    inputs its hooks wrap) and the section's data."""
    step = _pipeline_arguments(arguments)
    model.annotate = True
    training = poptorch.trainingModel(
        model, _options(step, poptorch.PipelinedExecution(*PIPELINE)),
        _optimizer(model))
    x, y = _data(step, arguments.pipeline_width)
    training(x, y)
    return training, x, y


class StageClock:
    """Times the stages a process runs during each call of a pipelined
    training model made through ``timed_call`` (lists in ``record``, one
    value per call): the call, the process's CPU time, the schedule steps
    (``model._staged._schedule.run``, one per optimizer step) and, inside
    them, the stages' forward passes (forward pre- and post-hooks on the
    ``StageModule``) and backward passes (from the
    module's full backward pre-hook, when the gradient of its outputs
    arrives, to the return of the ``PipelineStage``'s
    ``backward_one_chunk``, when autograd has finished the micro-batch's
    backward pass, parameter gradients included). The module's full
    backward hook is no end mark: it fires when the gradients of the
    module's positional inputs are ready, which for the first stage (no
    input needs one) is at once."""

    def __init__(self, model) -> None:
        # Expected for the first stage, whose inputs need no gradient (see
        # above); only the pre-hook is used.
        warnings.filterwarnings(
            "ignore", message="Full backward hook is firing when gradients "
            "are computed with respect to module outputs")
        staged = model._staged
        processes = staged._processes
        self.stages = ([processes.stage] if processes is not None
                       else list(range(len(staged._modules))))
        self.record: Dict[str, list] = collections.defaultdict(list)
        self._totals = dict.fromkeys(CLOCKED[2:], 0.0)
        self._forward_from = 0.0
        self._backward_from: Optional[float] = None
        schedule = staged._schedule
        inner = schedule._schedule
        pipeline_stages = (inner._stages if hasattr(inner, "_stages")
                           else [inner._stage])
        for pipeline_stage in pipeline_stages:
            module = staged._modules[pipeline_stage.stage_index]
            module.register_forward_pre_hook(self._forward_starts)
            module.register_forward_hook(self._forward_ends)
            module.register_full_backward_pre_hook(self._backward_starts)
            pipeline_stage.backward_one_chunk = self._timed_backward(
                pipeline_stage.backward_one_chunk)
        schedule.run = self._timed_window(schedule.run)

    def timed_call(self, call: Callable) -> Callable:
        """``call`` recording its times at each call."""
        def timed():
            self._totals = dict.fromkeys(CLOCKED[2:], 0.0)
            start, cpu = time.perf_counter(), time.process_time()
            call()
            self.record["call"].append(time.perf_counter() - start)
            self.record["cpu"].append(time.process_time() - cpu)
            for name, total in self._totals.items():
                self.record[name].append(total)
        return timed

    def _forward_starts(self, *_) -> None:
        self._forward_from = time.perf_counter()

    def _forward_ends(self, *_) -> None:
        self._totals["forward"] += time.perf_counter() - self._forward_from
        self._totals["forwards"] += 1

    def _backward_starts(self, *_) -> None:
        self._backward_from = time.perf_counter()

    def _timed_window(self, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._totals["window"] += time.perf_counter() - start
        return timed

    def _timed_backward(self, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._backward_from = None
            called = time.perf_counter()
            result = function(*args, **kwargs)
            start = (called if self._backward_from is None
                     else self._backward_from)
            self._totals["backward"] += time.perf_counter() - start
            self._totals["backwards"] += 1
            return result
        return timed


def pipeline_worker(arguments) -> None:
    """One process of the 2-process pipeline (``--worker DIR``): trains the
    annotated MLP for two warm-up calls, then times ``--pipeline-calls``
    calls and writes the times to ``DIR/process<rank>.json``."""
    torch.set_num_threads(1)
    training, x, y = _staged_training(arguments,
                                      _pipeline_model(arguments))
    training(x, y)
    clock = StageClock(training)
    call = clock.timed_call(lambda: training(x, y))
    for _ in range(arguments.pipeline_calls):
        call()
    rank = int(os.environ["RANK"])
    with open(os.path.join(arguments.worker, f"process{rank}.json"),
              "w", encoding="utf-8") as output:
        json.dump({"stages": clock.stages, **clock.record}, output)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_pipeline_workers(arguments) -> List[Dict[str, list]]:
    """Start the two worker processes with torchrun's variables (one torch
    thread each); their records, by rank."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, os.path.abspath(__file__),
                   "--worker", directory]
        for name in ("width", "layers", "micro_batch", "accumulation",
                     "iterations", "calls"):
            command += [f"--pipeline-{name.replace('_', '-')}",
                        str(getattr(arguments, f"pipeline_{name}"))]
        # OpenMPI's variables would take precedence over torchrun's.
        inherited = {name: value for name, value in os.environ.items()
                     if not name.startswith("OMPI_COMM_WORLD_")}
        port = str(_free_port())
        started = []
        failures = []
        try:
            for rank in range(2):
                environment = dict(inherited, RANK=str(rank),
                                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                                   POPTORCH_DISTRIBUTED_TIMEOUT="120")
                started.append(subprocess.Popen(
                    command, env=environment, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True))
            for rank, process in enumerate(started):
                _, err = process.communicate(timeout=600)
                if process.returncode:
                    failures.append(f"worker {rank} exited with "
                                    f"{process.returncode}:\n{err}")
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if failures:
            raise RuntimeError("\n".join(failures))
        results = []
        for rank in range(2):
            with open(os.path.join(directory, f"process{rank}.json"),
                      encoding="utf-8") as saved:
                results.append(json.load(saved))
    return results


def _median_of_rounds(records: List[Dict[str, list]],
                      values: Callable[[Dict[str, list]], List[float]]
                      ) -> float:
    """The median over the rounds of each round's median."""
    return statistics.median(statistics.median(values(record))
                             for record in records)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _time_row(name: str, records: List[Dict[str, list]],
              expected: int) -> None:
    for record in records:
        counts = set(record["forwards"] + record["backwards"])
        if counts != {expected}:
            print(f"(warning: {name}: {sorted(counts)} forward / backward "
                  f"passes timed per call, not {expected})")

    def median(key: str) -> float:
        return _median_of_rounds(records, lambda record: record[key])

    idle = _median_of_rounds(records, lambda record: [
        1 - (f + b) / w for f, b, w in zip(
            record["forward"], record["backward"], record["window"])])
    outside = _median_of_rounds(records, lambda record: [
        c - w for c, w in zip(record["call"], record["window"])])
    print(f"| {name} | {_ms(median('call'))} | {_ms(median('cpu'))} | "
          f"{_ms(median('window'))} | {_ms(median('forward'))} | "
          f"{_ms(median('backward'))} | {idle:.1%} | {_ms(outside)} |")


def processes_table(arguments) -> None:
    step = _pipeline_arguments(arguments)
    width, accumulation = arguments.pipeline_width, step.accumulation
    rows = step.iterations * accumulation * step.micro_batch
    print(f"\n### 2-stage pipeline on 2 CPU processes vs the same model in "
          f"one process: MLP of 2 blocks of {arguments.pipeline_layers} x "
          f"(Linear({width}, {width}) + ReLU), S = {step.micro_batch}, G = "
          f"{accumulation}, D = {step.iterations} ({rows} samples per "
          "call), one torch thread per process, median of "
          f"{arguments.pipeline_rounds} rounds\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = _pipeline_model(arguments)
    x, y = _data(step, width)
    staged, _, _ = _staged_training(arguments, copy.deepcopy(base))
    clock = StageClock(staged)
    passes = [poptorch_pass(copy.deepcopy(base), x, y, step),
              clock.timed_call(lambda: staged(x, y))]
    seconds: List[List[float]] = [[], [], []]
    staged_records: List[Dict[str, list]] = []
    worker_records: List[List[Dict[str, list]]] = []
    for _ in range(arguments.pipeline_rounds):
        clock.record.clear()
        for record, median in zip(seconds, interleaved_medians(
                passes, arguments.pipeline_repeats)):
            record.append(median)
        # The warm-up call is the first one recorded.
        staged_records.append({key: values[1:]
                               for key, values in clock.record.items()})
        workers = run_pipeline_workers(arguments)
        worker_records.append(workers)
        # A call ends in collectives of both processes: the slower
        # process's median is the pipeline's time per call.
        seconds[2].append(max(statistics.median(w["call"])
                              for w in workers))
    torch.set_num_threads(threads)
    names = ["(a) one process, trainingModel, unannotated (one graph)",
             "(b) one process, 2 stages one after the other",
             "(c) 2 processes, one stage each"]
    medians = [statistics.median(record) for record in seconds]
    print("| run | samples/s | each round | (c) / this |")
    print("|---|---|---|---|")
    for name, per_call, record in zip(names, medians, seconds):
        rounds = ", ".join(f"{rows / s:,.0f}" for s in record)
        print(f"| {name} | {rows / per_call:,.0f} | {rounds} | "
              f"{per_call / medians[2]:.2f} |")
    print(f"\n(c) / (a) = {medians[0] / medians[2]:.2f}, (c) / (b) = "
          f"{medians[1] / medians[2]:.2f}")
    expected = step.iterations * accumulation
    print("\n#### Where a call's time goes, ms per call (the CPU time is "
          "the process's, all its threads)\n")
    print("| process (stages) | call | CPU time | schedule steps | forward "
          "| backward | idle in the schedule steps | outside the schedule "
          "steps |")
    print("|---|---|---|---|---|---|---|---|")
    _time_row("(b) one process (0 and 1)", staged_records, 2 * expected)
    for rank in range(2):
        records = [workers[rank] for workers in worker_records]
        _time_row(f"(c) process {rank} (stage {records[0]['stages'][0]})",
                  records, expected)
    bubble = 1 / (accumulation + 1)
    print(f"\nTheoretical 1F1B bubble for K = 2 stages and M = G = "
          f"{accumulation} micro-batches: (K - 1) / (M + K - 1) = "
          f"{bubble:.1%} of each stage's time.")

    def busy(record: Dict[str, list]) -> List[float]:
        return [f + b for f, b in zip(record["forward"], record["backward"])]

    slowdown = sum(_median_of_rounds([workers[rank] for workers in
                                      worker_records], busy)
                   for rank in range(2)) / _median_of_rounds(staged_records,
                                                             busy)
    print(f"\nThe stages' forward and backward passes took {slowdown:.2f} "
          "times as long in (c), both processes together, as in (b)"
          + (": the processes did not each have a core to themselves "
             "(other load on the machine?), so (c) is below what two free "
             "cores give." if slowdown > 1.25 else "."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4,
                        help="K: blocks, one stage each")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=8,
                        help="G: micro-batches per optimizer step; a "
                        "pipeline needs at least 2 K - 1")
    parser.add_argument("--iterations", type=int, default=4,
                        help="D: optimizer steps per call")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--memory-width", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); one by "
                        "default, steadier on a shared machine")
    parser.add_argument("--pipeline-width", type=int, default=1024,
                        help="2-process pipeline: width of the MLP")
    parser.add_argument("--pipeline-layers", type=int, default=3,
                        help="2-process pipeline: Linear + ReLU per block")
    parser.add_argument("--pipeline-micro-batch", type=int, default=128)
    parser.add_argument("--pipeline-accumulation", type=int, default=8,
                        help="2-process pipeline: G, at least 3")
    parser.add_argument("--pipeline-iterations", type=int, default=2,
                        help="2-process pipeline: D")
    parser.add_argument("--pipeline-calls", type=int, default=9,
                        help="2-process pipeline: timed calls per worker "
                        "run")
    parser.add_argument("--pipeline-repeats", type=int, default=5,
                        help="2-process pipeline: interleaved calls of the "
                        "one-process runs per round")
    parser.add_argument("--pipeline-rounds", type=int, default=3,
                        help="2-process pipeline: rounds of the one-process "
                        "runs then a worker run")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-processes", action="store_true",
                        help="skip the 2-process pipeline")
    arguments = parser.parse_args()
    if arguments.worker is not None:
        pipeline_worker(arguments)
        return
    if arguments.pipeline_accumulation < 3:
        parser.error("--pipeline-accumulation must be at least 3 for a "
                     "pipeline of 2 stages")
    if arguments.accumulation < 2 * arguments.blocks - 1:
        parser.error("--accumulation must be at least 2 * blocks - 1 for "
                     "the pipeline")
    if arguments.threads > 0:
        torch.set_num_threads(arguments.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    if not arguments.skip_throughput:
        throughput_table(arguments)
    if not arguments.skip_memory:
        memory_tables(arguments)
    if not arguments.skip_processes:
        processes_table(arguments)


if __name__ == "__main__":
    main()
