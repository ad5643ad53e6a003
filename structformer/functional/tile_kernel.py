"""The CPU kernel of Sparsifiner's block connectivity (`csrc/`), built on first use.

`block_tile_attention(q, k, v, block_indices, block_size, scale)` is Eq. 4–6 on whole kept key tiles, as
`block_gathered_attention` computes it, without copying the tiles: a BLAS GEMM per kept tile where it lies in
K and V, ATen's softmax in between, query tiles in parallel. `block_connectivity(...)` picks those tiles
(Eq. 1–3 on tile means and the top tiles, as `pooled_block_scores` + `top_tiles` do) in one pass per head
instead of about fifteen small torch ops (inference: the tiles carry no gradient). The attention has a
backward (`csrc/block_tile_attention_backward.cpp`, the autograd Function `_TileAttention`), so it trains.
No attention dropout.

The source is compiled once per machine and torch build with the system's C++ compiler (`$CXX`, else `c++`),
about 20 s on 2 cores, against torch's headers and libraries (its GEMMs are the MKL ones libtorch_cpu exports, its
threads torch's OpenMP runtime), and loaded with `torch.ops.load_library`. The library lands in
`$STRUCTFORMER_KERNEL_DIR`, else `$XDG_CACHE_HOME/structformer/kernels` (default `~/.cache/...`; a per-user
folder under the temp dir when that cannot be created, used only while no other user can write in it), in a
folder named by a hash of the source, torch's version, the compiler (its file) and the flags, written to a
temporary name and renamed. The flags pin x86-64's baseline instruction set, so a cache shared by different CPUs
(a home on NFS) holds a library every one of them runs.
It exists only where all of that does: Linux on x86-64, torch with OpenMP and MKL, a compiler. Elsewhere,
or with `STRUCTFORMER_NO_KERNEL=1`, `unavailable_reason()` says why and the layer's impl='auto' runs the
gathered path instead; a missing compiler (or a `$CXX` that names none) or a failed build says so in one warning
per process, `STRUCTFORMER_NO_KERNEL=1` in none.

Dtype policy: the kernel computes in float32 or float64 only (its GEMMs are MKL's sgemm/dgemm). Under CPU autocast
`block_tile_attention` casts float16/bfloat16 inputs to float32, runs the kernel with autocast off and casts the
output to the autocast dtype (gradients flow back through the casts); the layer's impl='auto' does not pick the
kernel under autocast (`usable`), it runs the gathered tiles in the autocast dtype as SDPA would. Outside autocast
half inputs are refused (ValueError). `block_connectivity` (the predictor) takes float32/64 only; its callers
upcast (`sparsifiner.predicted_tiles` computes in float32).
"""
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from ..atomic import stale_temporaries, temporary_sibling, write_text_atomically
from .flop_formulas import register_flop_formulas
from .precision import LOW_PRECISION, upcast
from .tracing import recording_graph

CSRC = Path(__file__).resolve().parent.parent / 'csrc'
SOURCES = tuple(CSRC / name for name in ('block_tile_attention.cpp', 'block_tile_attention_backward.cpp',
                                         'block_connectivity.cpp'))
HEADERS = (CSRC / 'tile_common.h',)
LIBRARY = 'block_tile_attention.so'
FAILED = 'build-failed.txt'         # beside where the library would be: the compiler that failed and its error
DTYPES = (torch.float32, torch.float64)
# x86-64's baseline instruction set, whatever the compiler's default (RHEL 10's GCC targets x86-64-v3, i.e. AVX2):
# one cached library then runs on every x86-64 CPU that shares the cache folder (a home directory on NFS across
# node types); the GEMMs (MKL) and the softmax (ATen) choose their instructions at run time anyway
COMPILE_FLAGS = ('-O3', '-std=c++20', '-fPIC', '-fopenmp', '-march=x86-64', '-mtune=generic')
LINK_FLAGS = ('-shared', '-fopenmp')


def cache_dir() -> Path:
    if os.environ.get('STRUCTFORMER_KERNEL_DIR'):
        return Path(os.environ['STRUCTFORMER_KERNEL_DIR'])
    base = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
    return Path(base) / 'structformer' / 'kernels'


def _compiler() -> Optional[str]:
    """`$CXX` where it is set, as build tools read it (a program and its leading words: `ccache g++`), else `c++`,
    else `g++`; None when none is found. A `$CXX` that names no program is not replaced by another compiler (the
    user asked for that one): `unavailable_reason` names it."""
    try:
        requested = shlex.split(os.environ.get('CXX', ''))
    except ValueError:                           # unbalanced quotes: names nothing runnable
        return None
    if requested:
        program = shutil.which(requested[0])
        return shlex.join([program, *requested[1:]]) if program else None
    return shutil.which('c++') or shutil.which('g++')


def _torch_folders():
    """torch's header and library folders (what torch.utils.cpp_extension names, without importing it: its
    import logs a CUDA notice on machines without CUDA)."""
    root = Path(torch.__file__).resolve().parent
    return [root / 'include', root / 'include' / 'torch' / 'csrc' / 'api' / 'include'], [root / 'lib']


def _compile_commands(compiler: str, scratch: Path, output: Path):
    """One command per source (object files, run side by side), then the link into `output`."""
    includes, libraries = _torch_folders()
    objects = [scratch / f'{source.stem}.o' for source in SOURCES]
    compile_flags = [*shlex.split(compiler), *COMPILE_FLAGS,
                     f'-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}', *(f'-I{p}' for p in includes)]
    compiles = [[*compile_flags, '-c', str(source), '-o', str(obj)] for source, obj in zip(SOURCES, objects)]
    # torch's own libgomp (same soname as the one already loaded), so the kernel's at::parallel_for shares
    # torch's OpenMP threads instead of starting a second runtime
    link = [*shlex.split(compiler), *LINK_FLAGS, *map(str, objects), '-o', str(output), *(f'-L{p}' for p in libraries),
            '-lc10', '-ltorch_cpu', '-lgomp', *(f'-Wl,-rpath,{p}' for p in libraries)]
    return compiles, link


# what a compiler says when the machine, not the source, stopped it (cc1plus killed by the OOM killer: g++ exits 1
# with "Killed signal terminated program cc1plus"; a full disk; no memory): worth another try on the next run
_TRANSIENT = ('signal terminated program', 'No space left on device', 'Cannot allocate memory', 'out of memory',
              'virtual memory exhausted', 'Disk quota exceeded')


class CompileError(RuntimeError):
    """A build command failed; `transient` when the machine stopped it (a signal, memory, disk), not the source."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


COMPILE_TIMEOUT_S = 600.0           # per stage (the compiles side by side, then the link); ~20-45 s is usual


def _run_all(commands, compiler: str) -> None:
    """Run the commands side by side; a failure names the compiler and its first error line. A compiler still
    running after COMPILE_TIMEOUT_S (a wrapper waiting on a license server or a remote cache) is killed and the
    failure is transient; so is every compiler when this process is interrupted (none is left running)."""
    running = []
    try:
        running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                   for c in commands]
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        # communicate() reads each error stream to its end while waiting (a compiler's error output can exceed a
        # pipe's buffer); the others keep compiling meanwhile
        finished = [(p.communicate(timeout=max(deadline - time.monotonic(), 0.0))[1], p.returncode, c)
                    for p, c in zip(running, commands)]
    except subprocess.TimeoutExpired:
        raise CompileError(f"compiling with {compiler} did not finish in {COMPILE_TIMEOUT_S:.0f} s", True) from None
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for stderr, code, command in finished:
        if code != 0:
            lines = [line for line in stderr.splitlines() if 'error' in line] or stderr.splitlines()[-1:] or ['?']
            what = next((Path(a).name for a in command if a.endswith('.cpp')), 'the library')
            transient = code < 0 or any(sign in stderr for sign in _TRANSIENT)
            reason = f'killed by signal {-code}' if code < 0 else lines[0][:300]
            raise CompileError(f"compiling {what} with {compiler} failed: {reason}", transient)


def _platform_reason() -> Optional[str]:
    if os.environ.get('STRUCTFORMER_NO_KERNEL', '') not in ('', '0'):
        return 'STRUCTFORMER_NO_KERNEL is set'
    if sys.platform != 'linux' or platform.machine().lower() not in ('x86_64', 'amd64'):
        return f'built for Linux on x86-64 only (this is {sys.platform} on {platform.machine()})'
    if not torch.backends.openmp.is_available() or not torch.backends.mkl.is_available():
        return 'this torch build has no OpenMP or no MKL (the kernel uses both)'
    return None


def _cache_key(compiler: str) -> str:
    """The cache folder's name: a hash of what the library depends on -- the sources, torch's build, the compiler
    itself (`_compiler_identity`: another compiler at the same path, upgraded in place or another node's on a
    shared home, builds its own copy, linked against its own libstdc++) and the flags (a change of flags is a new
    library). No ISA feature: the flags pin the baseline (COMPILE_FLAGS). No Python version: the library has no
    Python ABI (torch.ops.load_library, no pybind)."""
    code = b''.join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    facts = (torch.__version__, torch.version.git_version, _compiler_identity(compiler), *COMPILE_FLAGS, *LINK_FLAGS)
    return hashlib.sha256(code + '|'.join(facts).encode()).hexdigest()[:16]


def _private_temp_folder() -> Path:
    """This user's folder under the shared temp dir, created 0700, and only when it is this user's and no one else
    can write in it: its name is predictable, so another user could otherwise create it first and plant a library
    there that this process would load (run)."""
    folder = Path(tempfile.gettempdir()) / f'structformer-kernels-{os.getuid()}'
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{folder} is not a folder of this user that only this user can write "
                      f"(owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): no library is loaded from it")
    return folder


def _scratch_beside(library: Path) -> Path:
    """A new scratch folder beside where `library` goes, its folder created first; OSError where it cannot be
    written (a read-only home or mount, another user's folder). Named for this process (atomic.temporary_sibling),
    so that a build killed before its cleanup ran (SIGTERM from a scheduler, kill -9) leaves a scratch folder the
    next build removes (`_build`), once that process is gone, never while it is building."""
    library.parent.mkdir(parents=True, exist_ok=True)
    return temporary_sibling(library, directory=True)


def _build(compiler: str) -> Path:
    """The library's path, compiled into the cache if it is not there yet (temp name, then rename)."""
    key = _cache_key(compiler)
    try:
        library = cache_dir() / key / LIBRARY
        if library.exists():
            return library
        scratch = _scratch_beside(library)
    # the cache cannot be written, even where its folder exists, or there is no home (HOME unset and a container's
    # user id without a passwd entry: Path.home() raises RuntimeError): a folder under the temp dir
    except (OSError, RuntimeError):
        library = _private_temp_folder() / key / LIBRARY
        if library.exists():
            return library
        scratch = _scratch_beside(library)
    folder = library.parent
    failed, compiler_id = folder / FAILED, _compiler_identity(compiler)
    try:
        with _one_build_at_a_time(folder):
            for stale in stale_temporaries(library):     # killed builds' scratch (the one waited for, if killed)
                shutil.rmtree(stale, ignore_errors=True)
            if library.exists():                 # built by the process this one waited for
                return library
            if failed.exists():
                failed_with, _, error = failed.read_text().partition('\n')
                if failed_with == compiler_id:
                    raise RuntimeError(f"an earlier build with this compiler failed ({error}); not retried until the "
                                       f"sources or the compiler change (or {failed} is deleted)")
            print(f"structformer: compiling the Sparsifiner CPU tile kernel (once, about 20 s) into {folder}",
                  file=sys.stderr, flush=True)
            partial = scratch / LIBRARY
            compiles, link = _compile_commands(compiler, scratch, partial)
            _run_all(compiles, compiler)
            _run_all([link], compiler)
            _flush_to_disk(partial)              # a crash after the rename leaves the whole library, not a stub
            os.replace(partial, library)
            failed.unlink(missing_ok=True)
            return library
    except CompileError as e:       # the source or the compiler at fault: remembered, not 20 s lost on every run
        if not e.transient:         # (a full disk, a killed compiler: the next run tries again)
            write_text_atomically(failed, f"{compiler_id}\n{type(e).__name__}: {e}")
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


BUILD_WAIT_S = 2 * COMPILE_TIMEOUT_S + 60   # longer than a build may take: past it, a builder is taken as stuck


@contextmanager
def _one_build_at_a_time(folder: Path):
    """Hold an exclusive flock on the cache folder while building into it: the other processes that start at once
    (DDP ranks, pytest-xdist workers) wait, then load the library the first one built, instead of compiling it N
    times side by side (N x 3 compilers of torch's headers, a gigabyte of memory each). The kernel releases a flock
    however its holder ends, so a killed builder leaves no stale lock; a stuck one is waited for BUILD_WAIT_S at
    most. Where the file system has no locks (some NFS mounts) every process builds, each in its own scratch
    folder, and the renames into place are atomic."""
    import fcntl                                 # POSIX only: not at module level (the package imports on Windows)
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        deadline, said = time.monotonic() + BUILD_WAIT_S, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                if not said:
                    print(f"structformer: waiting for another process's build of the tile kernel in {folder}",
                          file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.2)
            except OSError:                      # no locks here
                break
        yield
    finally:
        os.close(handle)                         # releases the lock


def _flush_to_disk(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _cut_short(library: Path, error: OSError) -> bool:
    """Whether a library that failed to load is a stub rather than a whole shared object: empty, no ELF header,
    or what the loader says of a file cut short (a build's rename outliving its data in a crash)."""
    try:
        with open(library, 'rb') as f:
            header = f.read(4)
    except OSError:
        return False
    return header != b'\x7fELF' or any(sign in str(error) for sign in ('too short', 'cannot read file data',
                                                                        'ELF load command'))


def _load(compiler: str) -> None:
    """Load the library, building it first if needed; a cached one cut short is built again (once)."""
    library = _build(compiler)
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        if not _cut_short(library, e):
            raise
        library.unlink(missing_ok=True)
        torch.ops.load_library(str(_build(compiler)))


def _compiler_identity(compiler: str) -> str:
    """The compiler's path, size and modification time (of each word of `ccache g++` that is a program): an
    upgraded compiler retries a build that failed."""
    identities = []
    for word in shlex.split(compiler):
        path = Path(shutil.which(word) or word).resolve()
        try:
            info = path.stat()
        except OSError:                          # not a file we can see (a flag): its name is all there is
            identities.append(word)
            continue
        identities.append(f"{path} {info.st_size} {info.st_mtime_ns}")
    return ' '.join(identities)


@lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when the kernel is loaded (building it first if needed), else why it cannot run here."""
    reason = _platform_reason()
    if reason:
        return reason
    compiler = _compiler()
    try:
        if compiler is None:                     # said once, as a failed build is: the layer runs slower without it
            requested = os.environ.get('CXX', '').strip()
            raise OSError(f"CXX={requested!r} names no program found on PATH" if requested
                          else 'no C++ compiler found (c++ or g++ on PATH; or set CXX)')
        _load(compiler)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        reason = f'{type(e).__name__}: {e}'
        warnings.warn(f"structformer: the Sparsifiner CPU tile kernel is unavailable ({reason}); "
                      "block connectivity runs the gathered path (STRUCTFORMER_NO_KERNEL=1 says so no more)",
                      RuntimeWarning, stacklevel=3)
        return reason
    # FlopCounterMode cannot look inside the library's ops: without these a model on the kernel counted 0 for its
    # attention (`structformer models --flops`, the benchmarks)
    register_flop_formulas(((torch.ops.structformer.block_tile_attention, _tile_attention_flops),
                            (torch.ops.structformer.block_tile_attention_backward, _tile_attention_backward_flops),
                            (torch.ops.structformer.block_connectivity, _connectivity_flops)))
    return None


def _tile_attention_flops(q_shape, k_shape, v_shape, indices_shape, block_size, scale, dense_rows, **kwargs) -> int:
    """QKᵀ and PV on whole kept key tiles for the sparse rows (a partial last key tile counted in full, as
    bench/sparse_flops.py counts 'whole padded tiles'), on every key for the `dense_rows`."""
    batch, heads, n_q, d = q_shape
    keys = (n_q - dense_rows) * indices_shape[-1] * block_size + dense_rows * k_shape[2]
    return 2 * 2 * batch * heads * d * keys


def _tile_attention_backward_flops(q_shape, k_shape, v_shape, out_shape_, grad_shape, indices_shape, block_size,
                                   scale, dense_rows, **kwargs) -> int:
    """Five products of the forward's size (P recomputed, dO Vᵀ, Pᵀ dO, dS K, dSᵀ Q), as torch counts SDPA's."""
    return 5 * _tile_attention_flops(q_shape, k_shape, v_shape, indices_shape, block_size, scale, dense_rows) // 2


def _connectivity_flops(q_shape, k_shape, w_down_shape, w_up_shape, scale, tau, up_threshold, block_size, kept,
                        **kwargs) -> int:
    """K_down = W_down K and A_down = Q K_downᵀ per (batch, head), then the query tiles' mean rows times the key
    tiles' basis means (the tile sums themselves are additions, as the masked path's are not counted either)."""
    batch, heads, n, d = q_shape
    p, n_k = w_down_shape
    key_tiles = -(-n_k // block_size)
    return 2 * batch * heads * (p * n_k * d + n * p * d + -(-n // block_size) * p * key_tiles)


def available() -> bool:
    return unavailable_reason() is None


def usable(q: torch.Tensor, dropout_p: float = 0.0) -> bool:
    """Whether impl='auto' may run the kernel on q: a float32/64 CPU tensor, no CPU autocast (there the attention
    runs in the autocast dtype, on the gathered path), no attention dropout, not inside torch.compile or a graph
    being exported or traced (`tracing.recording_graph`: an exporter cannot translate the kernel), and the
    library loads."""
    return (q.device.type == 'cpu' and q.dtype in DTYPES and not torch.is_autocast_enabled('cpu') and not dropout_p
            and not torch.compiler.is_compiling() and not recording_graph() and available())


def _require_kernel() -> None:
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"the Sparsifiner CPU tile kernel is unavailable: {reason}")


@contextmanager
def _argument_errors():
    """The ops' own checks (TORCH_CHECK) as a ValueError of their first line, which names the argument."""
    try:
        yield
    except RuntimeError as e:
        raise ValueError(str(e).splitlines()[0]) from None


def _blas_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when BLAS can read its rows in place (contiguous channels, rows at least d apart; the head views
    of a qkv projection are), else a copy with row-major strides (e.g. of an expanded tensor, whose rows share
    memory). The copy is `clone(memory_format=contiguous_format)`, not `contiguous()`: torch counts a tensor whose
    size-1 dims carry any stride as contiguous, and `contiguous()` returns it as it is, so one token (or one channel)
    read from transposed storage, token stride 1 < d, reached the ops' checks (lda >= d) and was refused."""
    return x if x.stride(-1) == 1 and x.stride(-2) >= x.shape[-1] else x.clone(memory_format=torch.contiguous_format)


class _TileAttention(torch.autograd.Function):
    """block_tile_attention with its backward (`csrc/block_tile_attention_backward.cpp`): P is recomputed from
    q and k, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = scale · dS K, dK = scale · dSᵀ Q, dV = Pᵀ dO on the kept
    tiles. gradcheck in float64 and autograd through masked_attention are its references (tests)."""

    @staticmethod
    def forward(ctx, q, k, v, block_indices, block_size: int, scale: float, dense_rows: int):
        out = torch.ops.structformer.block_tile_attention(q, k, v, block_indices, block_size, scale, dense_rows)
        ctx.save_for_backward(q, k, v, out, block_indices)
        ctx.settings = (block_size, scale, dense_rows)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, block_indices = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a second derivative): the kernel's backward has no derivative of its own, so the
            # gradients come from autograd through the same attention in torch's ops, which it differentiates again
            # (n×m scores: this path is for second-order work, not for speed)
            with torch.enable_grad():
                again = _tile_attention_in_torch_ops(q, k, v, block_indices, *ctx.settings)
            grads = torch.autograd.grad(again, (q, k, v), grad_out, create_graph=True, allow_unused=True)
            return (*grads, None, None, None, None)
        with torch.no_grad():
            grads = torch.ops.structformer.block_tile_attention_backward(q, k, v, out, _blas_rows(grad_out),
                                                                        block_indices, *ctx.settings)
        return (*grads, None, None, None, None)


def _tile_attention_in_torch_ops(q, k, v, block_indices, block_size: int, scale: float, dense_rows: int):
    """The kernel's function written out: softmax over the kept key tiles (every key for the first `dense_rows`
    queries), one n×m masked product. Differentiable any number of times; the kernel's tests hold it to the same
    references as the kernel."""
    n, m = q.shape[-2], k.shape[-2]
    tiles = -(-m // block_size)
    kept_tiles = torch.zeros(*block_indices.shape[:-1], tiles, dtype=torch.bool, device=q.device)
    kept_tiles.scatter_(-1, block_indices, True)                          # [B, H, query tiles, key tiles]
    mask = kept_tiles.repeat_interleave(block_size, -2)[..., :n, :].repeat_interleave(block_size, -1)[..., :m]
    if dense_rows:
        mask[..., :dense_rows, :] = True
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores.masked_fill(~mask, float('-inf')), dim=-1) @ v


def block_tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                         block_size: int, scale: Optional[float] = None, dense_rows: int = 0) -> torch.Tensor:
    """Eq. 4–6 on the kept key tiles `block_indices` [B, H, query tiles, kept] of q [B, H, n, d], k, v
    [B, H, m, d] (any strides with contiguous channels), differentiable in q, k and v; the first `dense_rows`
    queries attend to every key. The output is [B, H, n, d] laid out as [B, n, H, d], so merging the heads is
    a view. The function of `block_gathered_attention`. Raises ValueError on input the kernel does not take.
    Dtype policy: float32/64 in and out; under CPU autocast, half inputs are cast to float32, the kernel runs
    in float32 with autocast off and the output is cast to the autocast dtype (module docstring)."""
    _require_kernel()
    tensors = (q, k, v)
    if torch.is_autocast_enabled('cpu') and any(t.dtype in LOW_PRECISION for t in tensors):
        with torch.autocast(device_type='cpu', enabled=False):
            out = block_tile_attention(*(upcast(t) for t in tensors), block_indices, block_size, scale, dense_rows)
        return out.to(torch.get_autocast_dtype('cpu'))                  # strides preserved: heads merge as a view
    if any(t.device.type != 'cpu' for t in tensors) or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the tile kernel takes float32 or float64 CPU tensors, got q {q.dtype} on {q.device}, "
                         f"k {k.dtype}, v {v.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (_blas_rows(t) for t in tensors)
    arguments = (q, k, v, block_indices.to(torch.int64).contiguous(), int(block_size), scale, int(dense_rows))
    with _argument_errors():
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _TileAttention.apply(*arguments)
        return torch.ops.structformer.block_tile_attention(*arguments)


def block_connectivity(q: torch.Tensor, k: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, scale: float,
                       tau: float, up_threshold: float, block_size: int, kept: int) -> torch.Tensor:
    """The block connectivity's top `kept` key tiles per query tile, [B, H, ⌈n/bs⌉, kept] int64: Eq. 1–3 on tile
    means in one op, from q and k [B, H, n, d] and the bases W_down, W_up [p, n] as the scores use them
    (`SparsifinerAttention.scoring_basis`): the key-tile means of W̃_up once per call (`pooled_basis`), then per
    (batch, head) K_down = W_down K (`down_projected_keys`), the softmax of scale · Q K_downᵀ, its coefficients
    above τ pooled per query tile, and the top tiles. Ties go to the lower tile index. No gradient (the tiles are a
    detached choice)."""
    _require_kernel()
    tensors = (q, k, w_down, w_up)
    if q.dtype not in DTYPES or any(t.device.type != 'cpu' or t.dtype != q.dtype for t in tensors):
        raise ValueError(f"the tile kernel takes float32 or float64 CPU tensors, got q {q.dtype} on {q.device}, "
                         f"k {k.dtype}, w_down {w_down.dtype}, w_up {w_up.dtype}")
    with _argument_errors():
        return torch.ops.structformer.block_connectivity(_blas_rows(q), _blas_rows(k), w_down.contiguous(),
                                                         w_up.contiguous(), float(scale), float(tau),
                                                         float(up_threshold), int(block_size), int(kept))
