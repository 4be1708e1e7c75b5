"""A forking server for the tests that run ``embedq`` as a real process (tests/faultutil.py).

One server process imports ``embedq.cli`` (torch, transformers: 2-5 s) once; each run is a
``fork`` of it that does what ``python -m embedq.cli ARGS`` does from there on. The run is a
real process all the same: its own pid, a kill point's SIGKILL / SIGINT kills it and only
it, its exit status comes from ``waitpid``, its files and fds close as a killed process's
do. What a fork cannot give — a different environment at import time — is kept exact by
one server per environment (the runner keys servers by the environment, less the per-run
kill variables): a test's ``PYTHONPATH`` (tests/data/nolinks' sitecustomize) or
``EMBEDQ_CPU_FEATURES`` gets a server started with it.

Protocol, one JSON object per line: the runner sends ``{"args", "env", "cwd", "fsize",
"timeout"}``; the server answers ``{"status", "timed_out", "out", "err"}`` (the ``waitpid``
status, a run past its timeout killed; stdout and stderr, read from pipes) when the run ends. It exits at the end of its stdin.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import select
import signal
import sys
import time
import traceback


def _child(req: dict) -> None:
    """In the forked child: become ``python -m embedq.cli ARGS``; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # never the server's request pipe
        for fd, w in ((1, req["out"]), (2, req["err"])):
            os.dup2(w, fd)  # pipes, as subprocess.run(capture_output=True) gives
        for fd in req["close"]:
            os.close(fd)
        os.close(null)
        # what subprocess's preexec_fn gave the child (faultutil.embedq): a foreground
        # run's SIGINT (Python's KeyboardInterrupt) and the file size limit
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if req.get("fsize") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
        sys.argv = [os.path.join(os.path.dirname(sys.modules["embedq.cli"].__file__), "__main__.py"),
                    *req["args"]]
        try:
            runpy.run_module("embedq.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            # as the interpreter ends on an unhandled Ctrl-C: the traceback, then killed by SIGINT
            traceback.print_exc()
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


def serve() -> None:
    import embedq.cli.app  # noqa: F401  (what every run would import: once, here)
    requests, answers = sys.stdin.buffer, sys.stdout
    for line in requests:
        req = json.loads(line)
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        req.update(out=out_w, err=err_w, close=[out_r, err_r, out_w, err_w])
        _flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        os.close(out_w)
        os.close(err_w)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        # the deadline is kept here, where the pid cannot have been reaped and reused
        deadline, timed_out, status = time.monotonic() + req["timeout"], False, None
        while status is None or open_fds(chunks):
            ready, _, _ = select.select(list(open_fds(chunks)), [], [], 0.005)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    os.close(fd)
                    chunks[fd].append(None)
            if status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                elif not timed_out and time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    timed_out = True
        out, err = (b"".join(c for c in chunks[fd] if c).decode(errors="replace") for fd in (out_r, err_r))
        answers.write(json.dumps({"status": status, "timed_out": timed_out, "out": out, "err": err}) + "\n")
        answers.flush()


def open_fds(chunks: dict) -> set[int]:
    """The output pipes not yet at their end."""
    return {fd for fd, c in chunks.items() if not c or c[-1] is not None}

if __name__ == "__main__":
    serve()
