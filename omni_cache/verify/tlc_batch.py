"""Several TLC runs per JVM: the JVM start, class loading and JIT warm-up are paid once per worker.

Owns: the tiny Java driver (``OmniTLCBatch``, compiled at first use with ``javac`` into a
cache folder), the JVM flags for short TLC runs, and ``TLCPool``: a few long-lived driver
JVMs, each running one TLC check at a time, fed over stdin.

Each run gets a fresh class loader over ``tla2tools.jar``, so none of TLC's static state
(``TLCGlobals``, ``UniqueString``'s table, the message printer...) carries from one model to
the next; the driver calls ``new TLC()``, ``handleParameters``, ``setResolver`` and
``process`` exactly as ``tlc2.TLC.main`` does and maps the result with
``EC.ExitStatus.errorConstantToExitStatus``, so the exit codes are TLC's own. TLC's output
(System.out/err) goes to one file per run. Robustness: a run that exceeds its timeout kills
its JVM (the run reports the timeout, as ``run_tlc`` does; the next run starts a new JVM);
a run whose JVM dies or that throws is rerun alone in its own JVM (``run_tlc``), so a
``System.exit`` inside TLC cannot change a result. Without ``javac``, or with
``OMNI_CACHE_TLC_BATCH=0``, every run is its own JVM.

Upholds nothing by itself: it runs the checks of I1-I9 faster (results are identical: the
manifest's pinned state counts are the check).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import omni_cache.verify.tlc_procs as tlc_procs

# A driver JVM is replaced after this many runs: each run's class loader is unloaded only when
# TLC's threads let go of it, so a long-lived JVM can run short of heap or metaspace (a full
# `--all-mutants` run with --jobs 1 once ended two checks in TLC's general error, exit 255).
MAX_RUNS_PER_JVM = 24
# TLC's exit status for a failure of TLC itself (out of memory, an internal error), never a
# verdict on the model: in a pooled JVM such a run is rerun alone in a fresh JVM.
EXIT_TLC_ERROR = 255

# Short TLC runs: C1 only (C2 compiles burn more CPU than a few-second run gains) and the
# serial collector (no GC threads); see docs/formal-verification.md.
FAST_JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

_DRIVER = r"""
import java.io.*;
import java.net.*;

/** omni-cache: run TLC checks read from stdin, each in a fresh class loader (no shared static state). */
public class OmniTLCBatch {
    public static void main(String[] a) throws Exception {
        URL jar = new File(a[0]).toURI().toURL();
        PrintStream proto = System.out;
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, "UTF-8"));
        String line;
        while ((line = in.readLine()) != null) {
            String[] f = line.split("\t");
            String[] args = java.util.Arrays.copyOfRange(f, 1, f.length);
            String result;
            try (URLClassLoader cl = new URLClassLoader(new URL[]{jar}, ClassLoader.getPlatformClassLoader());
                 PrintStream out = new PrintStream(new FileOutputStream(f[0]), true, "UTF-8")) {
                Thread.currentThread().setContextClassLoader(cl);
                System.setOut(out);
                System.setErr(out);
                try {
                    Class<?> tlc = Class.forName("tlc2.TLC", true, cl);
                    Object t = tlc.getConstructor().newInstance();
                    if (!(Boolean) tlc.getMethod("handleParameters", String[].class).invoke(t, (Object) args)) {
                        result = "EXIT\t1";
                    } else {
                        String main = (String) tlc.getMethod("getMainFile").invoke(t);
                        String dir = (String) Class.forName("util.FileUtil", true, cl)
                            .getMethod("parseDirname", String.class).invoke(null, main);
                        Class<?> fts = Class.forName("util.SimpleFilenameToStream", true, cl);
                        Object resolver = dir.isEmpty() ? fts.getConstructor().newInstance()
                                                        : fts.getConstructor(String.class).newInstance(dir);
                        tlc.getMethod("setResolver", Class.forName("util.FilenameToStream", true, cl)).invoke(t, resolver);
                        int ec = (Integer) tlc.getMethod("process").invoke(t);
                        int code = (Integer) Class.forName("tlc2.output.EC$ExitStatus", true, cl)
                            .getMethod("errorConstantToExitStatus", int.class).invoke(null, ec);
                        result = "EXIT\t" + code;
                    }
                } catch (Throwable e) {
                    e.printStackTrace(out);
                    result = "THREW\t" + e;
                }
                out.flush();
            } finally {
                System.setOut(proto);
                System.setErr(proto);
            }
            proto.println(result.replace('\n', ' '));
            proto.flush();
        }
        System.exit(0);
    }
}
"""

_compile_lock = threading.Lock()


def driver_classpath(java: str) -> Path | None:
    """The folder holding the compiled driver (compiled once per source and JDK), or None
    when batching is off or ``javac`` is missing or fails."""
    if os.environ.get("OMNI_CACHE_TLC_BATCH", "1") == "0":
        return None
    javac = shutil.which("javac", path=str(Path(java).resolve().parent)) or shutil.which("javac")
    if javac is None:
        return None
    key = hashlib.sha1(f"{_DRIVER}\n{Path(javac).resolve()}".encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"omni-cache-tlc-batch-{os.getuid()}-{key}"
    with _compile_lock:
        if (folder / "OmniTLCBatch.class").is_file():
            return folder
        build = Path(tempfile.mkdtemp(prefix="omni-cache-tlc-batch-build-"))
        (build / "OmniTLCBatch.java").write_text(_DRIVER)
        proc = subprocess.run([javac, "-nowarn", "OmniTLCBatch.java"], cwd=build, capture_output=True, check=False)
        if proc.returncode != 0 or not (build / "OmniTLCBatch.class").is_file():
            shutil.rmtree(build, ignore_errors=True)
            return None
        try:
            build.rename(folder)
        except OSError:  # another process compiled it first
            shutil.rmtree(build, ignore_errors=True)
        return folder if (folder / "OmniTLCBatch.class").is_file() else None


@dataclass
class _Worker:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    tmp: Path
    num_runs: int = 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        tlc_procs.ended(self.proc)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _end_gracefully(worker: _Worker) -> None:
    """Close the driver's stdin (it exits after its current run), wait briefly, then kill."""
    assert worker.proc.stdin is not None, "Popen was given stdin=PIPE"
    with contextlib.suppress(OSError):
        worker.proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.proc.wait(timeout=10)
    worker.close()


class TLCPool:
    """Driver JVMs, started lazily, one TLC check at a time each. ``run`` is thread-safe: a
    caller takes an idle JVM (or starts one), runs its check, and gives the JVM back."""

    def __init__(self, java: str, jar: Path, classpath: Path) -> None:
        self._java, self._jar, self._cp = java, jar, classpath
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def _start(self) -> _Worker:
        tmp = Path(tempfile.mkdtemp(prefix="omni-tlc-jvm-"))
        try:
            proc = tlc_procs.start(
                [self._java, *FAST_JVM_FLAGS, f"-Djava.io.tmpdir={tmp}", "-cp", str(self._cp), "OmniTLCBatch",
                 str(self._jar)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None, "Popen was given stdout=PIPE"
            for ln in proc.stdout:
                lines.put(ln.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        worker = _Worker(proc, lines, tmp)
        with self._lock:
            self._all.append(worker)
        return worker

    def run(self, args: list[str], output: Path, timeout_s: float) -> tuple[int, str] | None:
        """Run ``tlc2.TLC args`` (the spec as an absolute path, the cfg by its name in the
        spec's folder) in a driver JVM, TLC's output into ``output``: (exit code, output), or
        None when the JVM died, the run threw or TLC itself failed (exit 255; the caller reruns
        it alone, and this JVM is retired). A timeout gives exit -1, as ``run_tlc`` does. A JVM
        is retired after ``MAX_RUNS_PER_JVM`` runs."""
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            worker = self._start()
        assert worker.proc.stdin is not None, "Popen was given stdin=PIPE"
        try:
            worker.proc.stdin.write("\t".join([str(output), *args]) + "\n")
            worker.proc.stdin.flush()
            line = worker.lines.get(timeout=timeout_s)
        except queue.Empty:
            worker.close()
            text = output.read_text(errors="replace") if output.is_file() else ""
            return -1, text + f"\nomni-cache: TLC timed out after {timeout_s:g}s"
        except OSError:
            worker.close()
            return None
        if line is None or not line.startswith("EXIT\t"):
            if line is None:
                worker.close()
            else:
                self._idle.put(worker)
            return None
        code = int(line.split("\t", 1)[1])
        worker.num_runs += 1
        if code == EXIT_TLC_ERROR or worker.num_runs >= MAX_RUNS_PER_JVM:
            self._retire(worker)
        else:
            self._idle.put(worker)
        if code == EXIT_TLC_ERROR:
            return None
        return code, output.read_text(errors="replace")

    def _retire(self, worker: _Worker) -> None:
        """End ``worker``'s JVM (it takes no more runs) and forget it."""
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        _end_gracefully(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for worker in workers:
            _end_gracefully(worker)

    def __enter__(self) -> TLCPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

