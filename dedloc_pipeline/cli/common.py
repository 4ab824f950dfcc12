"""What every command shares: the one place that reports failures, the common options, and opening a run."""

from __future__ import annotations

import importlib
import logging
import sys
import traceback

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from ..model.data import DataError
from ..monitoring import stop as signals
from ..protocol.run import ORGANIZER_KEY_ENV, Run, RunError
from ..storage.bucket import Bucket, Damaged, StorageError
from ..trust import identity
from ..trust.identity import IdentityError
from .init_options import describe, one_line

# click's exceptions, wherever this typer takes click from (recent typers vendor it)
_cx = importlib.import_module(typer.BadParameter.__module__)
_PASS = tuple({typer.Exit, typer.Abort, *(getattr(_cx, n) for n in ("Exit", "Abort", "NoArgsIsHelpError")
                                          if hasattr(_cx, n))})
# the top-level modules of pyproject.toml's extras, which a volunteer's install leaves out
EXTRAS = {"prefect": "organizer", "matplotlib": "organizer", "pyarrow": "organizer", "zstandard": "organizer",
          "prefect_dask": "scale", "datasets": "eval", "seqeval": "eval", "faker": "eval"}
# what a user can fix: a bad value, a missing run, file or key, a bucket refusing access
_ERRORS = (RunError, DataError, StorageError, IdentityError, ValueError, ValidationError, FileNotFoundError,
           PermissionError)


class _Group(TyperGroup):
    """Every failure ends in one line on stderr, ``error: ...``, and a non-zero exit status.

    The commands raise; this is the one place that says how. What the user can fix (``_ERRORS``)
    and usage errors exit 2; usage errors come from click, which would otherwise draw a multi-line
    panel; so does a command of an extra's side run on a volunteer's install, naming the extra to
    add (``EXTRAS``). Anything the commands did not anticipate (a botocore error, a bug), which
    would otherwise print only a traceback, exits 1 with its type; the traceback is still shown
    first when logging is verbose. Ctrl-C exits 130, quietly; SIGTERM and SIGHUP are taken as Ctrl-C
    (every command cleans up after them as after it) and exit 143 and 129.
    """

    def invoke(self, ctx):
        signals.as_interrupt()
        try:
            return super().invoke(ctx)
        except _PASS:
            raise
        except _cx.ClickException as exc:
            msg = one_line(exc.format_message()).replace("Value error, ", "")
            sub = exc.ctx.command_path if getattr(exc, "ctx", None) is not None else ctx.command_path
            if isinstance(exc, _cx.UsageError):
                msg += f" (see '{sub} --help')"
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(exc.exit_code or 2)
        except Damaged as exc:  # a record `dedloc repair` sees says so: the way back
            from ..organizer.repair import advice
            typer.echo(f"error: {describe(exc)}{advice(exc.key)}", err=True)
            raise typer.Exit(2)
        except _ERRORS as exc:
            typer.echo(f"error: {describe(exc)}", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt as exc:
            raise typer.Exit(signals.exit_status(exc))
        except Exception as exc:
            missing = (exc.name or "").partition(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
            extra = EXTRAS.get(missing)
            if extra is not None:
                typer.echo(f"error: '{ctx.command_path} {ctx.invoked_subcommand}' needs {missing}, of the "
                           f"{extra} extra, which a volunteer's install leaves out: "
                           f"pip install 'dedloc-pipeline[{extra}]'", err=True)
                raise typer.Exit(2)
            if logging.getLogger().isEnabledFor(logging.INFO):
                traceback.print_exc()
            typer.echo(f"error: {type(exc).__name__}: {one_line(str(exc))}", err=True)
            raise typer.Exit(1)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  help="Volunteer pretraining through an object-storage bucket.")

BucketOpt = typer.Option(..., "--bucket", help="fsspec URL: a path, file://, s3://bucket/prefix, memory://")
RunOpt = typer.Option(..., "--run", help="run name inside the bucket")
EndpointOpt = typer.Option(None, "--endpoint-url", envvar="AWS_ENDPOINT_URL",
                           help="S3 endpoint (MinIO, R2); credentials come from the usual AWS variables")


def setup(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def organizer_key(signs: str):
    """The ``--organizer-key`` option of a command that writes organizer records (``signs``)."""
    return typer.Option(None, envvar=ORGANIZER_KEY_ENV, metavar="FILE",
                        help=f"the organizer's private key: signs {signs} (signed runs)")


def open_run(bucket: str, run: str, endpoint: str | None, organizer_key: str | None = None) -> Run:
    return Run(Bucket(bucket, endpoint_url=endpoint, create=False), run,
               organizer=identity.load(organizer_key) if organizer_key else None)
