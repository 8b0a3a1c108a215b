"""Builds or loads the C++ CPU Adam kernel and exposes it as typed functions.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` and
ninja, and cached (``TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``).
Setting ``TWINFLOW_BUILD_EXT=1`` while installing builds it ahead of time.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sysconfig
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from twinflow.base import node
from twinflow.base.notice import notice, notice_on_first_rank

log = logging.getLogger(__name__)

SIMD_LEVELS = {"scalar": 0, "avx2": 1, "avx512": 2}
SIMD_NAMES = {level: name for name, level in SIMD_LEVELS.items()}
# the 8-bit ops' tensor arguments (checked to be in host memory before a call)
Q8_TENSORS = "params grads exp_avg_codes exp_avg_scales exp_avg_sq_codes exp_avg_sq_scales out_copies master_lows"

CSRC = Path(__file__).resolve().parents[2] / "csrc"
"""The directory holding the kernel's C++ sources (a source checkout's ``csrc/``); tests may point it elsewhere."""
_SOURCES = ("cpu_adam.cpp", "kernel_scalar.cpp", "kernel_avx2.cpp", "kernel_avx512.cpp")
_CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]
_LOAD_LOCK = threading.Lock()
loaded = False
"""Whether :func:`load` has made the kernel's ops available; tests may reset it to make the next load run again."""
# torch decides inside cpp_extension.load() whether to compile, so a compile is known only by how long the load
# takes: a cached kernel loads in well under this (0.04 s), a compile takes 10-45 s on 2 cores. Past it, one line
# says why the program is quiet (a progress bar would otherwise stall with no explanation); a cached load says nothing.
BUILD_NOTICE_AFTER_S = 1.0
"""Seconds a kernel load may take before a notice says it is compiling; tests may replace it."""
# A build takes about 15-60 s; a lock older than this is left by a build that was killed (torch would wait forever).
LOCK_WAIT_S = 600.0
"""Seconds to wait for another process's build lock before calling it stale; tests may replace it."""


class BuildError(RuntimeError):
    """The C++ kernel could not be built; the message says what is missing."""


def _compiler() -> str:
    """CXX if set, else g++ where present (else c++)."""
    return os.environ.get("CXX") or ("g++" if shutil.which("g++") else "c++")


def missing_build_tools() -> list[str]:
    """What building the kernel lacks here (compiler, ninja, Python headers, sources), each with how to get it;
    empty when everything is present. Tests may replace it."""
    problems = []
    cxx = _compiler()
    if shutil.which(cxx) is None:
        problems.append(
            f"C++ compiler {cxx!r} not found: install one (Debian/Ubuntu: `apt-get install g++`) or point CXX at it"
        )
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401  (the PyPI package puts a binary on PATH)
        except ImportError:
            problems.append("ninja not found: `pip install ninja`")
    include = sysconfig.get_paths().get("include", "")
    if not (Path(include) / "Python.h").exists():
        problems.append(
            f"Python headers not found in {include!r}: install them (Debian/Ubuntu: `apt-get install python3-dev`)"
        )
    missing_sources = [s for s in _SOURCES if not (CSRC / s).exists()]
    if missing_sources:
        problems.append(
            f"kernel sources {missing_sources} not found under {CSRC}: install twinflow from a source "
            "checkout (`pip install -e .`) or build it ahead of time with TWINFLOW_BUILD_EXT=1"
        )
    return problems


def load_prebuilt() -> bool:
    """Loads the library built by setup.py (TWINFLOW_BUILD_EXT=1), if present: whether it did. Tests may replace
    it."""
    for path in sorted(Path(__file__).resolve().parents[1].glob("_C*.so")):  # twinflow._C
        torch.ops.load_library(str(path))
        log.debug("loaded prebuilt kernel %s", path)
        return True
    return False


def build_and_load() -> None:
    """Compiles the kernel (or finds torch's cached build) and loads it; BuildError naming what is missing or
    what failed. Tests may replace it."""
    problems = missing_build_tools()
    if problems:
        raise BuildError("cannot build the twinflow CPU Adam kernel:\n  - " + "\n  - ".join(problems))
    from torch.utils import cpp_extension

    log.info("loading the twinflow CPU Adam kernel (compiled on first use, cached afterwards)")
    build_notice = _BuildNotice()
    # Seen on one host: built through the `c++` name, the library came out
    # without libstdc++ and every C++ exception (each argument check) crashed
    # the process. Naming g++ and libstdc++ explicitly avoids that.
    saved_cxx = os.environ.get("CXX")
    os.environ["CXX"] = _compiler()
    try:
        _wait_for_other_build(cpp_extension)
        cpp_extension.load(
            name="twinflow_cpu_adam",
            sources=[str(CSRC / s) for s in _SOURCES],
            extra_cflags=_CFLAGS + os.environ.get("TWINFLOW_EXTRA_CFLAGS", "").split(),
            extra_ldflags=["-fopenmp", "-lstdc++"],
            is_python_module=False,
            verbose=os.environ.get("TWINFLOW_VERBOSE_BUILD") == "1",
        )
        build_notice.finish()
    except BuildError:
        raise
    except Exception as exc:  # the compiler's own message is in exc
        raise BuildError(
            f"building the twinflow CPU Adam kernel failed: {exc}\n"
            "Set TWINFLOW_VERBOSE_BUILD=1 to see the compiler's output. The build needs a C++17 "
            "compiler with OpenMP (g++ >= 9), ninja, and the Python headers."
        ) from exc
    finally:
        build_notice.cancel()
        if saved_cxx is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = saved_cxx


def _wait_for_other_build(cpp_extension: object) -> None:
    """Waits (at most LOCK_WAIT_S) while another process builds the kernel; a lock that outlives that was left
    by a build that was killed, and torch would wait for it forever: BuildError naming the file and the fix."""
    try:
        lock = Path(cpp_extension._get_build_directory("twinflow_cpu_adam", verbose=False)) / "lock"
    except Exception:  # torch's layout changed: leave the waiting to torch
        return
    deadline = time.monotonic() + LOCK_WAIT_S
    while lock.exists():
        if time.monotonic() >= deadline:
            raise BuildError(
                f"the kernel's build lock {lock} has been held for over {LOCK_WAIT_S:.0f} s: a build was "
                "probably killed while compiling. If no other process is building twinflow, delete that file "
                "and run again"
            )
        time.sleep(0.5)


class _BuildNotice:
    """Two notices around a load that compiles: one once it has taken BUILD_NOTICE_AFTER_S, and then one
    with the seconds it took. A load that ends sooner (the cached kernel) gives neither."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._lock = threading.Lock()  # the start line is written before the end line, never after it
        self._announced = False
        self._over = False
        self._timer = threading.Timer(BUILD_NOTICE_AFTER_S, self._announce)
        self._timer.daemon = True
        self._timer.start()

    def _announce(self) -> None:
        with self._lock:
            if self._over:
                return
            self._announced = True
            where = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
            notice("compiling the CPU Adam kernel (first use only, 10-45 s on 2 cores; cached under %s)", where)

    def finish(self) -> None:
        """The load succeeded: says how long it took, if the start was announced."""
        with self._lock:
            self._over = True
            if self._announced:
                notice("CPU Adam kernel compiled in %.0f s", time.monotonic() - self._start)
        self._timer.cancel()

    def cancel(self) -> None:
        """The load ended (a failure raises its own error): no start line from now on."""
        with self._lock:
            self._over = True
        self._timer.cancel()


def load() -> None:
    """Makes ``torch.ops.twinflow.*`` available, building the kernel if needed."""
    global loaded
    if loaded:
        return
    with _LOAD_LOCK:
        if loaded:
            return
        if os.environ.get("TWINFLOW_FORCE_JIT") == "1" or not load_prebuilt():
            build_and_load()
        register_fakes()
        loaded = True


@functools.cache
def cpu_simd_level() -> int:
    """The best SIMD level this CPU supports: 0 scalar, 1 AVX2, 2 AVX-512."""
    load()
    return int(torch.ops.twinflow.cpu_simd_level())


def resolve_simd(simd: str | None = None) -> int:
    """The SIMD level to run: ``simd``, else ``TWINFLOW_SIMD``, else the best available.

    Raises ValueError for an unknown name or a level this CPU lacks.
    """
    name = simd if simd is not None else os.environ.get("TWINFLOW_SIMD", "").strip().lower()
    best = cpu_simd_level()
    if not name or name == "auto":
        return best
    if name not in SIMD_LEVELS:
        raise ValueError(
            f"TWINFLOW_SIMD={name!r} is not a known kernel path; expected one of {sorted(SIMD_LEVELS)} or 'auto'"
        )
    if SIMD_LEVELS[name] > best:
        raise ValueError(
            f"TWINFLOW_SIMD={name!r} is not supported by this CPU (best available: {SIMD_NAMES[best]!r}); "
            "unset TWINFLOW_SIMD or choose a lower path"
        )
    return SIMD_LEVELS[name]


def default_num_threads() -> int:
    """Threads the kernel uses unless told otherwise: TWINFLOW_NUM_THREADS, else this rank's share of the host's
    cores where twinflow chooses them (:func:`automatic_share`), else torch's intra-op thread count (a user's
    OMP_NUM_THREADS). Called for every chunk: the share is computed once."""
    value = os.environ.get("TWINFLOW_NUM_THREADS")
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"TWINFLOW_NUM_THREADS={value!r}: expected a positive integer, e.g. 16")
        return threads
    share = automatic_share()
    return len(share.cpus) if share is not None else torch.get_num_threads()


def automatic_share() -> node.CoreShare | None:
    """This rank's share of the host's cores (:func:`twinflow.base.node.core_share`) where twinflow chooses the
    kernel's threads: TWINFLOW_NUM_THREADS unset, and torch left one thread to each of several local ranks
    (torchrun's OMP_NUM_THREADS=1); None otherwise. Its worker is pinned to it unless TWINFLOW_PIN=0."""
    ranks = node.local_ranks()
    if os.environ.get("TWINFLOW_NUM_THREADS") or torch.get_num_threads() != 1 or ranks < 2:
        return None
    return announced_share(node.local_rank(), ranks, os.environ.get("TWINFLOW_PIN", "1") != "0")


@functools.cache
def announced_share(rank: int, ranks: int, pin: bool) -> node.CoreShare:
    """:func:`twinflow.base.node.core_share`, read once per argument (a ``functools.cache``) and said in a notice.
    Tests may clear its cache (``announced_share.cache_clear()``) to read the host again."""
    share = node.core_share(rank, ranks, pin=pin)
    notice_on_first_rank("%s", share.describe())
    return share


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    out_copies: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
    simd: str | None = None,
    sources: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    peek: bool = False,
) -> None:
    """One Adam/AdamW step over many CPU tensors in one parallel region, in place.

    ``params``, ``exp_avgs`` and ``exp_avg_sqs`` are float32; ``grads`` float32, bfloat16 or float16. ``steps[i]``
    is tensor i's step count *after* this update (1 on the first step). If ``out_copies`` is given, the updated
    params are also written, rounded, into those bfloat16/float16 (or float32) tensors: the staging buffers that
    carry weights back to the GPU. ``grad_scale`` multiplies every gradient first (a clipping coefficient or an
    inverse loss scale known only after the gradients were staged). With ``sources = (params_in, exp_avgs_in,
    exp_avg_sqs_in)`` the state is read from those tensors and written to ``params``, ``exp_avgs`` and
    ``exp_avg_sqs`` (out of place, each pair the same tensor or apart): the state a step started from stays as it
    was. ``peek``: the same arithmetic, but only ``out_copies`` (then required) are written and the state stays as
    it was; the same call without ``peek`` later commits the state, its masters the ones the copies were rounded
    from (new weights first, the state behind them). Every argument is checked before anything is written. The GIL
    is released while the kernel runs.
    """
    if len(params) == 0:
        return
    _on_the_host(locals(), "params grads exp_avgs exp_avg_sqs out_copies sources")
    load()
    (torch.ops.twinflow.adam_peek_ if peek else torch.ops.twinflow.adam_step_)(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(out_copies) if out_copies is not None else [],
        [int(s) for s in steps],
        *_scalars(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd),
        [t for ts in sources for t in ts] if sources is not None else [],
    )


def _on_the_host(args: dict, names: str) -> None:
    """Refuses, before the op, a tensor of `args`' lists `names` not in host memory: a CUDA tensor crashed the op
    (a segmentation fault on an H200), a meta tensor reached its fake kernel and did nothing."""
    for name in names.split():
        tensors = [t for ts in args[name] for t in ts] if name == "sources" and args[name] else args[name] or ()
        for i, t in enumerate(tensors):
            if not t.is_cpu:  # 10x cheaper than reading .device on the step's path
                raise ValueError(f"{name}[{i}] is on {t.device}; the CPU Adam kernel needs CPU tensors (.cpu())")


def _scalars(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd) -> list:
    """The kernels' scalar arguments, in their schema's order and types."""
    return [float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw_mode),
            bool(bias_correction), float(grad_scale), int(num_threads) if num_threads else default_num_threads(),
            resolve_simd(simd)]  # fmt: skip


def bandwidth_probe_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    out_copies: Sequence[torch.Tensor] | None = None,
    num_threads: int | None = None,
    simd: str | None = None,
    sources: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    peek: bool = False,
) -> None:
    """Moves the same bytes as :func:`adam_step_` (with `peek`, as its peek) with trivial arithmetic.

    Its throughput is the memory-bandwidth ceiling for the Adam access pattern
    on this host. It overwrites its arguments with meaningless values.
    """
    if len(params) == 0:
        return
    _on_the_host(locals(), "params grads exp_avgs exp_avg_sqs out_copies sources")
    load()
    torch.ops.twinflow.bandwidth_probe_(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(out_copies) if out_copies is not None else [],
        int(num_threads) if num_threads else default_num_threads(),
        resolve_simd(simd),
        [t for ts in sources for t in ts] if sources is not None else [],
        bool(peek),
    )


def register_fakes() -> None:
    """Registers shape functions so the ops trace under FakeTensor / torch.compile (once per process, after the
    library is loaded). Tests may replace it."""

    @torch.library.register_fake("twinflow::adam_step_")
    def _adam_step_fake(*args, **kwargs) -> None:
        return None

    @torch.library.register_fake("twinflow::adam_peek_")
    def _peek_fake(*args, **kwargs) -> None:
        return None

    @torch.library.register_fake("twinflow::bandwidth_probe_")
    def _probe_fake(*args, **kwargs) -> None:
        return None

    @torch.library.register_fake("twinflow::adam_step_q8_")
    def _q8_fake(*args, **kwargs) -> None:
        return None

    @torch.library.register_fake("twinflow::adam_peek_q8_")
    def _q8_peek_fake(*args, **kwargs) -> None:
        return None

    @torch.library.register_fake("twinflow::bandwidth_probe_q8_")
    def _q8_probe_fake(*args, **kwargs) -> None:
        return None


def q8_block_size() -> int:
    """Elements per block of the 8-bit moments (one scale each)."""
    load()
    return int(torch.ops.twinflow.q8_block_size())


def adam_step_q8_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg_codes: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_codes: Sequence[torch.Tensor],
    exp_avg_sq_scales: Sequence[torch.Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    out_copies: Sequence[torch.Tensor] | None = None,
    index_bases: Sequence[int] | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
    simd: str | None = None,
    master_lows: Sequence[torch.Tensor] | None = None,
    peek: bool = False,
) -> None:
    """:func:`adam_step_` with 8-bit moments (``state_precision="int8"``), in place.

    Per block of :func:`q8_block_size` elements of each tensor: ``exp_avg``
    as int8 codes and ``exp_avg_sq`` as uint8 codes, small floats relative to
    one power-of-two scale per block (a uint8 exponent field), stochastically
    rounded (the noise is a hash of the element's index, ``index_bases[i]`` +
    position, and the step: the same on every path and thread split). The
    weight update uses the new moments in float32; they are then encoded.
    Fresh state: codes and scales zero. :mod:`twinflow.precision.compact` has the
    format, and decodes and encodes it.

    With ``master_lows`` (``state_precision="int8_m24"``) the masters are
    24 bits: ``params`` are bfloat16 tensors holding their top 16 bits and
    ``master_lows`` uint8 tensors the next 8; each step rounds the new
    master to them stochastically (the same hash's low 8 bits), and the
    out copies are the rounded masters.

    ``peek``: the same arithmetic, but only ``out_copies`` (then required)
    are written; codes, scales and masters stay as they were, and the same
    call without ``peek`` later commits them (its masters the ones the
    copies were rounded from).
    """
    if len(params) == 0:
        return
    _on_the_host(locals(), Q8_TENSORS)
    load()
    (torch.ops.twinflow.adam_peek_q8_ if peek else torch.ops.twinflow.adam_step_q8_)(
        list(params),
        list(grads),
        list(exp_avg_codes),
        list(exp_avg_scales),
        list(exp_avg_sq_codes),
        list(exp_avg_sq_scales),
        list(out_copies) if out_copies is not None else [],
        [int(s) for s in steps],
        [int(b) for b in index_bases] if index_bases is not None else [0] * len(params),
        *_scalars(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale, num_threads, simd),
        list(master_lows) if master_lows is not None else [],
    )


def bandwidth_probe_q8_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg_codes: Sequence[torch.Tensor],
    exp_avg_scales: Sequence[torch.Tensor],
    exp_avg_sq_codes: Sequence[torch.Tensor],
    exp_avg_sq_scales: Sequence[torch.Tensor],
    *,
    out_copies: Sequence[torch.Tensor] | None = None,
    num_threads: int | None = None,
    simd: str | None = None,
    master_lows: Sequence[torch.Tensor] | None = None,
    peek: bool = False,
) -> None:
    """Moves the same bytes as :func:`adam_step_q8_` (with `peek`, as its peek) with trivial arithmetic: the
    memory ceiling of the 8-bit mode's access pattern on this host (with ``master_lows``: of 24-bit masters). It
    overwrites its arguments with meaningless values."""
    if len(params) == 0:
        return
    _on_the_host(locals(), Q8_TENSORS)
    load()
    state = (exp_avg_codes, exp_avg_scales, exp_avg_sq_codes, exp_avg_sq_scales)
    torch.ops.twinflow.bandwidth_probe_q8_(
        *(list(ts) for ts in (params, grads, *state, out_copies or [])),
        int(num_threads) if num_threads else default_num_threads(),
        resolve_simd(simd),
        list(master_lows) if master_lows is not None else [],
        bool(peek),
    )
