"""`phalanx` commands, and Python scripts, forked from a process that imported torch and phalanx
once, for the tests that run one to its end or side by side (`procs.run`, `forks.start`).

A fresh `phalanx` process spends its first seconds importing torch, phalanx and torch._dynamo (5-6 s
of CPU on the 2-core CI machine), and the end-to-end tests run a great many. Here a server process
(this file, run as a script) imports them once; each command is a fork of it that takes the test's
working directory, environment and arguments, writes its output to files and runs `phalanx.cli.main`
as the console script does (or the script, as `python SCRIPT` does). It is a real process, with its
own pid, exit code and signals, whose workers the launcher starts as it starts any; what it shares
is the imports, as the launcher's workers share those of its own server. Commands whose environment
differs in what a process reads as it starts (the thread pools' sizes, PYTHONPATH) fork from a
server of their own. Tests of how the command starts, of its process tree, or that signal it, start
a fresh process (`procs.start`).

The server reads requests (a JSON object a line) on its stdin and answers on its stdout: the
command's pid once forked, its exit code (a negative signal number, as `subprocess` gives) once it
ended. It ends when its stdin closes, with the test process.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# the console script of the interpreter the tests run in
SCRIPT = Path(sys.executable).with_name("phalanx")


# --- the tests' side -----------------------------------------------------------------------------


class Server:
    """The server process and the commands forked from it, which several test threads may run side
    by side."""

    def __init__(self, env: dict[str, str]):
        # its own errors: not into the output pytest captures for the test that started it
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self._arrived = threading.Condition(self._lock)
        self._reader = threading.Thread(target=self._read, name="forks-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self._arrived:
                self._answers.setdefault(answer.pop("id"), {}).update(answer)
                self._arrived.notify_all()
        with self._arrived:  # the server ended: no answer will come
            self._answers[-1] = {"ended": True}
            self._arrived.notify_all()

    def _wait(self, request: int, key: str, timeout: float | None) -> Any:
        with self._arrived:
            arrived = self._arrived.wait_for(
                lambda: key in self._answers.get(request, {}) or -1 in self._answers, timeout
            )
            if key in self._answers.get(request, {}):
                return self._answers[request][key]
        if not arrived:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.seek(0)
        errors = self.log.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"the tests' command server ended (code {self.proc.poll()}):\n{errors}")

    @property
    def alive(self) -> bool:
        with self._lock:
            return -1 not in self._answers and self.proc.poll() is None

    def start(
        self, args: list[str], cwd: Path, env: dict[str, str], script: Path | None = None
    ) -> Command:
        """`phalanx ARGS...` (or `python SCRIPT ARGS...`) forked in `cwd` with `env`, its output
        captured."""
        command = Command(self, next(self._ids), args, script)
        request = {"id": command.id, "args": args, "cwd": str(cwd), "env": env}
        request["script"] = None if script is None else str(script)
        request |= {"stdout": str(command.out), "stderr": str(command.err)}
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        pid = self._wait(command.id, "pid", 120)
        if pid is None:
            raise RuntimeError("the tests' command server did not fork a command in 120 s")
        command.pid = pid
        return command

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Command:
    """A forked command, as `subprocess.Popen` is waited for, read and ended."""

    def __init__(self, server: Server, id: int, args: list[str], script: Path | None):
        self.server, self.id = server, id
        self.args = ["phalanx" if script is None else str(script), *args]
        self.pid = -1
        self.returncode: int | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="phalanx-forked-")
        self.out, self.err = Path(self._folder.name, "stdout"), Path(self._folder.name, "stderr")

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code; None where it still runs after `timeout` seconds (0: a look)."""
        if self.returncode is None:
            self.returncode = self.server._wait(self.id, "code", timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its output once it ended; `subprocess.TimeoutExpired` after `timeout` seconds (it is
        not killed: `subprocess.Popen.communicate`'s way)."""
        if self.wait(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        out = self.out.read_text(errors="replace")
        err = self.err.read_text(errors="replace")
        self._folder.cleanup()
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended, not yet waited for
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# what a process reads of its environment as it starts and imports torch (the interpreter's
# settings, its path, the thread pools' sizes): commands that differ in these fork from servers of
# their own
STARTUP = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH")

_servers: dict[tuple[tuple[str, str], ...], Server] = {}
_starting = threading.Lock()


def start(args: list[str], cwd: Path, env: dict[str, str], script: Path | None = None) -> Command:
    """`phalanx ARGS...` (or `python SCRIPT ARGS...`) forked from the server of `env`'s start-up
    variables, started at the first such call."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP)))
    with _starting:
        server = _servers.get(key)
        if server is None or not server.alive:
            server = _servers[key] = Server(env)
            atexit.register(server.close)
    return server.start(args, cwd, env, script)


def run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float, script: Path | None = None
) -> subprocess.CompletedProcess:
    """`phalanx ARGS...` (or `python SCRIPT ARGS...`) forked, to its end: its exit code and
    output. One still running after `timeout` seconds is killed and raises
    `subprocess.TimeoutExpired`, as `subprocess.run`."""
    command = start(args, cwd, env, script)
    try:
        out, err = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.communicate()
        raise
    code = command.poll()
    assert code is not None  # its output comes once it ended
    return subprocess.CompletedProcess(command.args, code, out, err)


# --- the server's side ---------------------------------------------------------------------------


def _send(answer: dict[str, Any]) -> None:
    os.write(1, (json.dumps(answer) + "\n").encode())


def _command(request: dict[str, Any]) -> None:
    """In the forked child: become the command, run it, exit with its code. Never returns."""
    code: int = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the server's requests are not the command's input
        os.close(null)
        for fd, name in [(1, "stdout"), (2, "stderr")]:
            file = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(file, fd)
            os.close(file)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = Path(request["script"] or SCRIPT)
        sys.argv = [str(script), *request["args"]]
        sys.path[0] = str(script.parent)  # as a script's path starts
        if request["script"] is None:
            from phalanx import cli

            code = cli.main(request["args"])
        else:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
    except SystemExit as e:  # argparse's --help and usage errors
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:  # the interpreter's own exit: its threads joined, then its exit handlers
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """Import what every command imports, then fork a command for each request until stdin
    closes."""
    import phalanx.cli  # noqa: F401
    import phalanx.commands  # noqa: F401
    import phalanx.preloaded  # noqa: F401 - torch, the launcher's workers' entry, torch._dynamo

    children: dict[int, int] = {}  # pid: request id
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            _send({"id": children.pop(pid), "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the tests ended
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _command(request)
            children[pid] = request["id"]
            _send({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    serve()
