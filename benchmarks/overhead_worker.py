"""One rank of the overhead benchmark: train N iterations one way, report the speed.

Usage (under torchrun): ``overhead_worker.py MODE MODEL STAGE WARMUP ITERS WORK_DIR
[--profile]``, MODE one of ``raw`` (a hand-written DeepSpeed loop on the ds_config the
runner resolves, reading its loss every ``LOG_INTERVAL`` iterations as a training script
logs it; every mode logs at that interval), ``runner``
(DeepSpeedRunner; the result carries the milliseconds its per-iteration check that
all ranks used the same parameters took), ``runner_find_unused`` (DeepSpeedRunner with
``find_unused_parameters=True``), ``runner_compiled`` (DeepSpeedRunner with MMEngine's
``compile=True``) and ``strategy`` (MMEngine's FlexibleRunner +
DeepSpeedStrategy, with the patches listed in ``STRATEGY_PATCHES`` applied here only).
On CUDA every mode uses NCCL and one GPU per rank. Rank 0 prints ``RESULT {json}``;
with ``--profile`` the measured iterations of rank 0 run under cProfile and the result
carries the time per iteration spent in each package's own code; with ``--spy FILE`` the
same from py-spy's samples of rank 0's measured iterations (no instrumentation).
"""
from __future__ import annotations

import time

PROCESS_START = time.time()

import collections  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402

STRATEGY_PATCHES = (
    'what importing mmengine_deepspeed (for the shared TinyGPT class) registered is undone: '
    "DeepSpeed's optimizers (so MMEngine's own registration runs) and MMEngine's "
    'DeepSpeedOptimWrapper is registered again over ours',
    'a stub deepspeed.runtime.fp16.onebit module (removed in DeepSpeed 0.19, imported by '
    "MMEngine's optimizer registration)",
    'the process group is created before FlexibleRunner (MMEngine init_dist calls '
    'torch.cuda.set_device on CPU)',
)
CUDA = torch.cuda.is_available()
# Every loop logs its loss this often (the runner's LoggerHook, the raw loop's own read).
LOG_INTERVAL = 10
BACKEND = 'nccl' if CUDA else 'gloo'
# Where a profiled function's own time is booked (first match wins).
PACKAGES = (('model', 'mmengine_deepspeed/demo/'),  # the benchmark's models live there
            ('mmengine_deepspeed', 'mmengine_deepspeed/'), ('mmengine', '/mmengine/'),
            ('deepspeed', '/deepspeed/'), ('torch (Python)', '/torch/'),
            ('benchmark', '/benchmarks/'))


def package_of(filename: str, function: str) -> str:
    """The profile row a function's own time goes to."""
    if filename == '~':  # C functions: collectives' waits apart from the rest
        return 'collective waits' if function.endswith('.wait>') else 'C / C++ ops'
    return next((name for name, part in PACKAGES if part in filename), 'other Python')


class Recorder:
    """Stamps the end of every iteration; profiles rank 0's measured ones on request.
    At the end of the warm-up, ``gc.freeze()`` in every mode alike.

    On CUDA each stamp waits for the GPU, in every mode alike, so that a stamp is
    when the iteration's work finished, not when it was queued.
    """

    def __init__(self, warmup: int, iters: int, profile: bool, spy: Optional[str] = None):
        self.warmup = warmup
        self.iters = iters
        self.stamps: list[tuple[float, float]] = []
        rank0 = int(os.environ['RANK']) == 0
        self.profiler = cProfile.Profile() if profile and rank0 else None
        self.spy_file = spy if rank0 else None
        self.pin = spy is not None
        self.spy: Optional[subprocess.Popen] = None
        # CPU time of this (the training) thread while sampled: what its code cost, where
        # wall time also counts the time the 2 ranks and the sampler wait for a core
        self.spy_cpu: list[float] = []

    def record(self) -> None:
        if CUDA:
            torch.cuda.synchronize()
        # CPU time too: it counts all threads (gloo's), and is less disturbed
        # than wall time by other jobs on a shared machine.
        self.stamps.append((time.time(), time.process_time()))
        if len(self.stamps) == self.warmup + 1:
            # What exists after the warm-up stays: the garbage collector no longer walks
            # it, so a collection is not booked to whichever code happened to allocate.
            gc.freeze()
            if self.profiler is not None:
                self.profiler.enable()
            cores = pin_for_sampling(self.spy_file is not None) if self.pin else None
            if self.spy_file is not None:
                self.spy = start_spy(self.spy_file, cores)
                self.spy_cpu.append(time.thread_time())
                self.stamps[-1] = (time.time(), time.process_time())  # from the first sample
        if self.spy is not None and len(self.stamps) == self.warmup + self.iters:
            self.spy_cpu.append(time.thread_time())
            self.spy.send_signal(signal.SIGINT)  # the measured iterations only
            said = self.spy.communicate()[0].decode(errors='replace')
            if self.spy_file is not None and not os.path.exists(self.spy_file):
                raise RuntimeError(f'py-spy wrote no samples: {said}')

    def profile_ms(self) -> Optional[dict[str, float]]:
        """Milliseconds per measured iteration by package (own time, not callees)."""
        if self.profiler is None:
            return None
        self.profiler.disable()
        steps = len(self.stamps) - self.warmup - 1
        totals: collections.Counter = collections.Counter()
        stats: Any = pstats.Stats(self.profiler).stats
        for (filename, _, function), (_, _, own, _, _) in stats.items():
            totals[package_of(filename, function)] += own
        return {name: seconds / steps * 1000 for name, seconds in totals.most_common()}


SPY_RATE = 1000  # samples per second


def pin_for_sampling(sampled: bool) -> Optional[set[int]]:
    """Give the sampled rank's (0) training thread a core of its own, every other thread
    (its gloo workers, the other ranks) and the sampler the rest; return the sampler's
    cores (None with one core: nothing pinned). Called at the end of the warm-up, when
    every thread the run uses exists.

    A thread that waits for a core is runnable, so py-spy counts its samples where it was
    preempted, mostly at system calls (``time.process_time()`` read 0.1-0.7 ms per
    iteration that way, for a call of under 1 us): on 2 cores shared by 2 ranks and the
    sampler, that waiting would be booked to whatever code made a system call. The
    sampled rank's gloo workers run the collectives' transfers (at ZeRO-3, one gather per
    module and iteration): on the training thread's core, they would preempt it too.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    training = threading.get_native_id()
    for thread in map(int, os.listdir('/proc/self/task')):
        os.sched_setaffinity(thread, {cores[0]} if sampled and thread == training
                             else set(cores[1:]))
    return set(cores[1:])


def start_spy(raw_file: str, cores: Optional[set[int]] = None) -> subprocess.Popen:
    """py-spy sampling this process's threads into ``raw_file`` until SIGINT, on
    ``cores``: no instrumentation, so small Python functions are not inflated as under
    cProfile."""
    spy = subprocess.Popen(
        ['py-spy', 'record', '--pid', str(os.getpid()), '--rate', str(SPY_RATE),
         '--nonblocking', '--threads', '--full-filenames', '--format', 'raw',
         '--output', raw_file], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores))
    assert spy.stdout is not None
    spy.stdout.readline()  # "Sampling process ...": sampling has started
    return spy


def spy_ms(raw_file: str, cpu_seconds: float, steps: int) -> dict[str, float]:
    """CPU milliseconds per iteration by package of the innermost Python frame: the
    training thread's (the one running this script's ``main``) CPU time over the
    measured iterations, shared out as its samples that were not idle (a wait in a
    collective or a sleep is idle; a thread that waits for a core is not, and its
    samples land where preemption finds it, in proportion to where its time goes).

    A sample whose innermost frame sits on a line that, in other samples, is calling one
    Python function (in 99 % of them: a nonblocking sampler reads a few torn stacks)
    caught that call's entry or its frame's release, and is charged to the callee's
    package. Without native frames, py-spy shows
    the release of a returning frame's locals under its caller: e.g. the autograd graph,
    held by the loss in MMEngine's ``run_iter``, is freed as that frame returns, and is
    charged to whichever frame called it (``--native`` stacks show ``THPFunction_dealloc``
    and ``Node::~Node`` there). Native sampling would settle it but pauses the process
    at every sample (3-4x slower iterations here), so the boundary is charged by rule.
    """
    samples: list[tuple[str, list[str], int]] = []
    callees: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(raw_file, encoding='utf-8') as f:
        for line in f:
            stack, _, count = line.rstrip('\n').rpartition(' ')
            thread, _, frames = stack.partition(';')
            chain = frames.split(';')
            samples.append((thread, chain, int(count)))
            for caller, callee in zip(chain, chain[1:]):
                callees[caller][callee.rpartition(':')[0]] += int(count)  # function, any line
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, chain, count in samples:
        leaf = chain[-1]
        if leaf in callees:
            (callee, calls), = callees[leaf].most_common(1)
            if calls >= 0.99 * sum(callees[leaf].values()):
                leaf = callee + ':'
        package = package_of(leaf[leaf.rfind('(') + 1:leaf.rfind(':')],
                             leaf.partition(' (')[0]) if '(' in leaf else 'other'
        threads[thread][package] += count
        threads[thread]['main'] += count if any('overhead_worker.py' in c for c in chain) else 0
    counts = threads[max(threads, key=lambda t: threads[t]['main'])]
    del counts['main']
    total = sum(counts.values())
    return {name: n / total * cpu_seconds / steps * 1000 for name, n in counts.most_common()}


class Clock(Hook):
    """Hands the end of every training iteration to the recorder."""

    priority = 'LOWEST'

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        self.recorder.record()


def model_and_data(model_name: str) -> tuple[dict, dict]:
    from benchmarks.common import BATCH, MODELS_CFG

    model = dict(MODELS_CFG[model_name], data_preprocessor=dict(type='BaseDataPreprocessor'))
    loader = dict(batch_size=BATCH[model_name], num_workers=0,
                  dataset=dict(type='RandomTokens', size=4096,
                               block_size=MODELS_CFG[model_name].get('block_size', 64)),
                  sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                  collate_fn=dict(type='default_collate'))
    return model, loader


def mmengine_cfg(model_name: str, iters: int, work_dir: str) -> dict:
    model, loader = model_and_data(model_name)
    return dict(
        model=model, work_dir=work_dir, train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-3)),
        default_hooks=dict(logger=dict(type='LoggerHook', interval=LOG_INTERVAL),
                           checkpoint=None),
        log_level='WARNING', randomness=dict(seed=0), launcher='pytorch',
        env_cfg=dict(dist_cfg=dict(backend=BACKEND)))


def run_raw(model_name: str, stage: int, iters: int, recorder: Recorder) -> int:
    import deepspeed
    from mmengine.registry import DATASETS, MODELS
    from torch.utils.data import DataLoader, DistributedSampler

    import mmengine_deepspeed.demo  # noqa: F401  the TinyGPT class
    from benchmarks.common import ds_config
    from mmengine_deepspeed.dist import init_distributed
    from mmengine_deepspeed.engine.banner import parameter_counts
    from mmengine_deepspeed.engine.spec import EngineSpecs
    init_distributed('pytorch', dict(backend=BACKEND))
    model_cfg, loader_cfg = model_and_data(model_name)
    torch.manual_seed(0)
    model = MODELS.build(model_cfg)
    model.init_weights()  # as both runners do: the same weights
    dataset = DATASETS.build(loader_cfg['dataset'])
    loader = DataLoader(dataset, batch_size=loader_cfg['batch_size'],
                        sampler=DistributedSampler(dataset, shuffle=True, seed=0))
    # the ds_config the runner trains with (batch filled, ZeRO-3's buffers sized to the
    # model, DeepSpeed's throughput timer off), so both loops run the same DeepSpeed
    optim_cfg = mmengine_cfg(model_name, iters, '')['optim_wrapper']
    specs = EngineSpecs.of_run(ds_config(stage, model=model_name), None, loader_cfg, optim_cfg,
                               None)
    specs.resolve(world_size=dist.get_world_size())
    spec = specs['model']
    spec.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, config=spec.finish(model),
                                      optimizer=spec.optimizer)
    batches = iter(loader)
    engine.train()
    logged = []
    for step in range(iters):
        batch = next(batches)
        loss = engine(batch['inputs'].to(engine.device), batch['targets'].to(engine.device),
                      mode='loss')['loss']
        engine.backward(loss)
        engine.step()
        if (step + 1) % LOG_INTERVAL == 0:  # as a training script logs its loss (a host read)
            logged.append(float(loss))
        recorder.record()
    return parameter_counts(engine.module)[0]


CHECK_SECONDS: list[float] = []


def time_the_unused_parameter_check() -> None:
    """Record how long each of the runner's same-parameters checks takes."""
    from mmengine_deepspeed.zero.unused_params import UsedParameters

    check = UsedParameters.check

    def timed(self: Any, *args: Any) -> None:
        start = time.perf_counter()
        check(self, *args)
        CHECK_SECONDS.append(time.perf_counter() - start)

    UsedParameters.check = timed  # type: ignore[method-assign]


def run_runner(model_name: str, stage: int, iters: int, work_dir: str,
               recorder: Recorder, find_unused: bool = False, compiled: bool = False) -> int:
    from mmengine.config import Config
    from mmengine.registry import RUNNERS

    import mmengine_deepspeed.demo  # noqa: F401  registers DeepSpeedRunner and TinyGPT
    from benchmarks.common import ds_config
    from mmengine_deepspeed.engine.banner import parameter_counts

    time_the_unused_parameter_check()
    cfg = mmengine_cfg(model_name, iters, work_dir)
    cfg.update(runner_type='DeepSpeedRunner', ds_config=ds_config(stage, model=model_name))
    if find_unused:
        cfg['model_wrapper_cfg'] = dict(find_unused_parameters=True)
    if compiled:
        cfg['compile'] = True
    runner = RUNNERS.build(Config(cfg))
    runner.register_hook(Clock(recorder))
    runner.train()
    return parameter_counts(runner.model.module)[0]


def run_strategy(model_name: str, stage: int, iters: int, work_dir: str,
                 recorder: Recorder) -> int:
    onebit = types.ModuleType('deepspeed.runtime.fp16.onebit')
    for name in ('OnebitAdam', 'OnebitLamb', 'ZeroOneAdam'):
        setattr(onebit, name, type(name, (torch.optim.Optimizer,), {}))
    sys.modules['deepspeed.runtime.fp16.onebit'] = onebit
    from mmengine._strategy.deepspeed import DeepSpeedOptimWrapper as MMEngineDeepSpeedOptimWrapper
    from mmengine.registry import OPTIM_WRAPPERS, OPTIMIZERS
    from mmengine.runner._flexible_runner import FlexibleRunner

    import mmengine_deepspeed.demo  # noqa: F401  the TinyGPT class
    from benchmarks.common import BATCH, ds_config
    from mmengine_deepspeed.engine.banner import parameter_counts
    from mmengine_deepspeed.engine.optimizers import DEEPSPEED_OPTIMIZERS

    for cls in DEEPSPEED_OPTIMIZERS:
        OPTIMIZERS._module_dict.pop(cls.__name__, None)
    OPTIM_WRAPPERS.register_module(module=MMEngineDeepSpeedOptimWrapper, force=True)
    if CUDA:
        torch.cuda.set_device(int(os.environ['LOCAL_RANK']))
    dist.init_process_group(BACKEND)
    cfg = mmengine_cfg(model_name, iters, work_dir)
    config = ds_config(stage, model=model_name)
    cfg['strategy'] = dict(type='DeepSpeedStrategy', zero_optimization=config['zero_optimization'],
                           bf16=config['bf16'],
                           train_micro_batch_size_per_gpu=BATCH[model_name])
    cfg['optim_wrapper'] = dict(type='DeepSpeedOptimWrapper',
                                optimizer=dict(type='AdamW', lr=1e-3))
    cfg.pop('env_cfg')
    runner = FlexibleRunner(**cfg)
    runner.register_hook(Clock(recorder))
    runner.train()
    return parameter_counts(runner.model.module)[0]


def main() -> None:
    from benchmarks.common import BATCH, train_flops_per_token

    # The same for all three modes: DeepSpeed 0.19's per-step FutureWarnings
    # from torch.distributed would otherwise be printed (and timed) each step.
    for message in ('all_gather_into_tensor', 'reduce_scatter_tensor'):
        warnings.filterwarnings('ignore', message=f'.*{message}` is deprecated',
                                category=FutureWarning)
    mode, model_name, stage, warmup, iters = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    work_dir = sys.argv[6]
    options = sys.argv[7:]
    recorder = Recorder(warmup, iters, profile='--profile' in options,
                        spy=options[options.index('--spy') + 1] if '--spy' in options else None)
    total = warmup + iters
    if mode == 'raw':
        params = run_raw(model_name, stage, total, recorder)
    elif mode.startswith('runner'):
        params = run_runner(model_name, stage, total, work_dir, recorder,
                            find_unused=mode == 'runner_find_unused',
                            compiled=mode == 'runner_compiled')
    else:
        params = run_strategy(model_name, stage, total, work_dir, recorder)
    profile = recorder.profile_ms()
    wall, cpu = zip(*recorder.stamps[warmup:])
    steps = len(wall) - 1
    if recorder.spy_file is not None:
        profile = spy_ms(recorder.spy_file, recorder.spy_cpu[1] - recorder.spy_cpu[0], steps)
    # CPU time per iteration, summed over the ranks.
    cpu_ms = torch.tensor([(cpu[-1] - cpu[0]) / steps * 1000], dtype=torch.float64,
                          device='cuda' if CUDA else 'cpu')
    dist.all_reduce(cpu_ms)
    if dist.get_rank() == 0:
        it_per_s = steps / (wall[-1] - wall[0])
        tokens_per_iter = BATCH[model_name] * dist.get_world_size() * \
            model_and_data(model_name)[1]['dataset']['block_size']
        print('RESULT ' + json.dumps(dict(
            mode=mode, model=model_name, stage=stage, it_per_s=it_per_s,
            cpu_ms_per_iter=float(cpu_ms),
            first_iter_s=recorder.stamps[0][0] - PROCESS_START, params=params,
            tokens_per_s=it_per_s * tokens_per_iter, world=dist.get_world_size(),
            flops_per_token=train_flops_per_token(model_name, params),
            device=torch.cuda.get_device_name() if CUDA else 'cpu', profile_ms=profile,
            check_ms=1000 * sum(CHECK_SECONDS[warmup:]) / max(1, len(CHECK_SECONDS[warmup:])))),
            flush=True)
    dist.barrier()
    dist.destroy_process_group()  # a clean exit (gloo can abort on teardown otherwise)


if __name__ == '__main__':
    main()
