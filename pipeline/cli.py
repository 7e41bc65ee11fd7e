"""The `elmo-pipeline` command: subcommands elmo, run (the Beam pipeline), plan (run --dry-run), train, evaluate,
export, probe, models, doctor."""
from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import logging
import os
import sys
import threading
import traceback
from typing import Callable, NoReturn

# numpy before anything imports torch: torch's extension imports numpy from its C init and drops whatever that import
# raised, a Ctrl-C (SIGINT) landing there too, and the command ran on to exit 0 (tests/test_cli.py, the interrupt
# raised inside numpy's import). Here such an interrupt ends the process as interrupted, before the command starts.
importlib.import_module("numpy")

# subcommand -> (module, help). Modules are imported only when their subcommand runs, except that
# building the parser imports each one for its add_arguments (no Beam import there).
SUBCOMMANDS = {
    "elmo": ("elmo_pipeline.pipeline.elmo_command", "embed a file of tokenized sentences into HDF5 (allennlp elmo)"),
    "run": ("elmo_pipeline.pipeline.run", "run the Beam pipeline"),
    "plan": ("elmo_pipeline.pipeline.run", "what `run` with the same flags would do (run --dry-run): nothing is written"),
    "train": ("elmo_pipeline.pipeline.train_command", "train or fine-tune a biLM (torchrun for several processes)"),
    "evaluate": ("elmo_pipeline.pipeline.evaluate_command", "forward, backward and mean perplexity of a biLM on held-out text"),
    "export": ("elmo_pipeline.pipeline.export_command", "export a training checkpoint to options.json + weights.hdf5 + vocab.txt"),
    "probe": ("elmo_pipeline.pipeline.probe_command", "train and evaluate a classifier on extracted vectors, per layer setting"),
    "models": ("elmo_pipeline.pipeline.models_command", "list the models known by name: sizes, dims, tokenization, cache state"),
    "doctor": ("elmo_pipeline.pipeline.doctor_command", "this machine: CPU, its flags, GPUs, and which compute dtypes run natively"),
}
# Subcommands whose module parses its own argv (module.main(argv), its own --help): the parser only lists them,
# so `elmo-pipeline --help` and the other subcommands never import Beam.
FORWARDED = {"run": [], "plan": ["--dry-run"]}    # subcommand -> flags it adds


def build_parser() -> argparse.ArgumentParser:
    from elmo_pipeline.pipeline.validate import OneLineParser     # a bad command line: one line `error: ...`, exit 2
    parser = OneLineParser(prog="elmo-pipeline", description="ELMo contextual word vectors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name not in FORWARDED:
            importlib.import_module(module).add_arguments(p)
            p.add_argument("--verbose", action="store_true", help="on failure, the traceback too (default: one "
                           "line `error: ...`)")
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from elmo_pipeline.fsio import redact, redact_logs
    redact_logs()          # every subcommand's log lines without secrets
    argv = sys.argv[1:] if argv is None else argv
    # `run` forwards everything to the Beam pipeline's own parser (Beam options included).
    if argv and argv[0] in FORWARDED:
        return importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(FORWARDED[argv[0]] + list(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args)
    except SystemExit as e:     # a subcommand's `error: ...` line (printed by the interpreter): one line, redacted
        if not isinstance(e.code, str):
            raise
        raise SystemExit(redact(" ".join(e.code.split()) if e.code.startswith("error:") else e.code)) from None
    except Exception as e:  # noqa: BLE001 - any other failure: one line, redacted (the traceback with --verbose)
        from elmo_pipeline.pipeline.exits import classify
        if args.verbose:
            print(redact("".join(traceback.format_exception(e))), end="", file=sys.stderr)
        print(f"error: {classify(e).message}", file=sys.stderr)
        return 1


def console(argv: list[str] | None = None) -> NoReturn:
    """The command's process (console script, `python -m elmo_pipeline`): main under process()."""
    process(lambda: main(argv))


def process(main_: Callable[[], int]) -> NoReturn:
    """A command's process: its standard streams guarded first (pipeline/streams.py: what it prints is dropped
    when nobody reads it, its status unchanged), then main_(), then exit with its status (exit_with). Ctrl-C
    before main_ handles it (while the command's modules are still imported, seconds) is one line `error: ...`
    and 130, as once it runs; SIGTERM the same with 143, and an interrupt Python dropped is raised again
    (_unwind_on_signals, pipeline/exits.py)."""
    from elmo_pipeline.pipeline.streams import guard, say
    guard()
    restore = _unwind_on_signals()
    interrupt = None
    try:
        status = main_()
    except KeyboardInterrupt as e:
        interrupt = e
    finally:
        dropped = restore()          # an interrupt Python dropped and that was not raised again before main_ ended
    if interrupt is not None or dropped is not None:
        from elmo_pipeline.pipeline.exits import classify
        failure = classify(interrupt or dropped)
        say(failure.line())
        status = failure.status
    exit_with(status)


AGAIN_SECONDS = 0.01   # a dropped interrupt's signal is sent again this late: the collector's callback has returned


def _unwind_on_signals() -> Callable[[], BaseException | None]:
    """SIGTERM (a scheduler's cancel, a pod's stop) raises exits.Terminated in the main thread, a KeyboardInterrupt:
    the command unwinds as from a Ctrl-C (its lease given back, its temporary files removed, --metrics-file and one
    `error:` line with status 143) instead of dying where it stands; a second SIGTERM while it unwinds ends the
    process at once (the default action). Only where SIGTERM has its default action (a host's own handler, or an
    inherited SIG_IGN, stays). An interrupt raised where Python drops exceptions (a weakref callback or __del__ that
    the collector ran: "Exception ignored in ...", and the command ran on to exit 0) is sent again from a thread, to
    land outside it; one still pending when the command's work ends is its status (process). Returns what puts the
    handlers before back and gives that interrupt."""
    import signal
    from elmo_pipeline.pipeline.exits import Terminated
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    main_thread, hook_before = threading.main_thread().ident, sys.unraisablehook
    state = {"raised": False, "dropped": None, "timer": None}

    def terminate(signum, frame):
        if state["raised"]:                     # a second SIGTERM: the default action, now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        state.update(raised=True, dropped=None)
        raise Terminated("SIGTERM")

    def interrupt(signum, frame):
        state["dropped"] = None
        raise KeyboardInterrupt

    def unraisable(u):
        if isinstance(u.exc_value, KeyboardInterrupt):    # dropped: its signal again, from a thread, once this is done
            again = signal.SIGTERM if isinstance(u.exc_value, Terminated) else signal.SIGINT
            state.update(raised=False, dropped=u.exc_value,
                         timer=threading.Timer(AGAIN_SECONDS, signal.pthread_kill, (main_thread, again)))
            state["timer"].start()
            return
        hook_before(u)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ours = {signal.SIGTERM: terminate if before[signal.SIGTERM] is signal.SIG_DFL else None,
            signal.SIGINT: interrupt if before[signal.SIGINT] is signal.default_int_handler else None}
    for sig, handler in ours.items():
        if handler is not None:
            signal.signal(sig, handler)
    sys.unraisablehook = unraisable

    def restore() -> BaseException | None:
        """The handlers before put back; the interrupt dropped and not raised again since, if any."""
        if state["timer"] is not None:
            state["timer"].cancel()
        sys.unraisablehook = hook_before
        for sig, handler in ours.items():
            if handler is not None:
                signal.signal(sig, before[sig])
        return state["dropped"]
    return restore


def exit_with(status: int) -> NoReturn:
    """End a command's process (`elmo-pipeline`, `python -m elmo_pipeline.pipeline.run`) with `status` once its work
    has returned (its files closed). The collector is frozen first: its collections at exit walk torch's millions of
    objects (0.46-0.54 s in a process that does not freeze, AMD EPYC Zen 4, family 25). Where the process is the
    command's own (_process_is_the_command), what the interpreter's exit does first (threads joined, atexit handlers
    run), then the product's last flush (stdout: a failure there is the command's, its `error:` line and status, 75
    for a full disk), then os._exit: without the teardown of every module and object (the command's closing line
    to its end: 0.15-0.16 s before, 0.04-0.06 s so; Intel Xeon, family 6 model 167: benchmarks.model_load's command
    exit column, benchmarks/README.md). Elsewhere (a host that runs the command in its own process, a profiler or a
    tracer attached) SystemExit, as any exit."""
    gc.freeze()
    shutdown = getattr(threading, "_shutdown", None)     # the interpreter's first step at exit (CPython 3.x)
    if shutdown is None or not isinstance(status, int) or not _process_is_the_command():
        sys.exit(status)
    shutdown()                    # non-daemon threads joined, executors' idle workers released
    worker_exit = sys.modules.get("elmo_pipeline.transforms.worker_exit")
    if worker_exit is not None:   # no teardown follows to wait for (a worker's exit does: its steps registered it)
        atexit.unregister(worker_exit.settle)
    atexit._run_exitfuncs()       # logging's flush, multiprocessing's and tempfile's clean-ups, ...
    try:
        sys.stdout.flush()        # guarded (pipeline/streams.py): a reader gone is no failure; a full disk is
    except (OSError, ValueError) as e:
        from elmo_pipeline.pipeline.exits import classify
        from elmo_pipeline.pipeline.streams import say
        failure = classify(e)
        say(failure.line())
        status = status or failure.status
    try:
        sys.stderr.flush()        # logs: nothing of the status depends on them
    except (OSError, ValueError, AttributeError):
        pass
    os._exit(status)


# The command's entry points: its console script (as pip writes it, named CONSOLE_SCRIPT) and the modules
# `python -m` runs (ENTRY_MODULES); what runs such a __main__: the interpreter itself (the script), or runpy (-m).
CONSOLE_SCRIPT = "elmo-pipeline"
ENTRY_MODULES = ("elmo_pipeline.__main__", "elmo_pipeline.pipeline.cli", "elmo_pipeline.pipeline.run",
                 "pipeline.cli", "pipeline.run")
_MAIN_CALLERS = ([], [("_run_code", "runpy"), ("_run_module_as_main", "runpy")])


def _process_is_the_command() -> bool:
    """Whether nothing in this process runs after the command: one of its entry points, as the process's __main__,
    called process() (directly or through console()), under no profiler or tracer, and no interactive prompt
    follows (`python -i`). Not so for a host that runs the command in its own process (a test runner, a wrapper
    script, runpy.run_module in a try, cProfile, a notebook's %run): it gets SystemExit and carries on."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return False              # a profiler or a tracer (coverage) writes its data at SystemExit or at exit
    if sys.flags.inspect or os.environ.get("PYTHONINSPECT"):
        return False              # `python -i`: its prompt follows the command
    frame = sys._getframe(2)      # exit_with's caller
    if frame is None or frame.f_code is not process.__code__:
        return False
    frame = frame.f_back
    if frame is not None and frame.f_code is console.__code__:
        frame = frame.f_back
    if frame is None or frame.f_code.co_name != "<module>" or frame.f_globals.get("__name__") != "__main__":
        return False
    spec = frame.f_globals.get("__spec__")
    if not (spec.name in ENTRY_MODULES if spec is not None
            else os.path.basename(frame.f_code.co_filename) == CONSOLE_SCRIPT):
        return False
    callers = []
    frame = frame.f_back
    while frame is not None:
        callers.append((frame.f_code.co_name, frame.f_globals.get("__name__")))
        frame = frame.f_back
    return callers in _MAIN_CALLERS


if __name__ == "__main__":
    console()
