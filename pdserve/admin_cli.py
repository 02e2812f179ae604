"""`pdserve admin`: the cluster's membership from the command line, through the
router's admin API (/admin, served when `pdserve serve --admin-api-key` is set).
No torch, no Ray."""
from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.error
import urllib.request

from pdserve import env
from pdserve.worker.messages import ROLES


def add_admin_parser(sub) -> None:
    admin = sub.add_parser("admin", help="list, add, drain, re-role and remove workers",
                           description="Change a running cluster's workers through its "
                           "router's admin API.")
    admin.add_argument("--url", default="http://127.0.0.1:8000",
                       help="the router's HTTP address (default: %(default)s)")
    admin.add_argument("--admin-api-key", default=env.admin_api_key(),
                       help="default: $PDSERVE_ADMIN_API_KEY")
    admin.add_argument("--timeout", type=float, default=600.0,
                       help="seconds to wait for the answer (default: %(default)s)")
    admin.add_argument("--cafile", default=None, help="CA bundle for an https --url")
    actions = admin.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every worker, its role, state and telemetry")
    add = actions.add_parser("add", help="start a worker of a role (answers at once, "
                             "the worker pending; see `list` or `show`)")
    add.add_argument("role", choices=ROLES)
    add.add_argument("--wait", action="store_true",
                     help="answer once the worker is in service")
    show = actions.add_parser("show", help="one worker, or one being added")
    show.add_argument("worker_id")
    for name, text in (("drain", "stop new work on a worker and wait for its requests"),
                       ("resume", "a drained worker takes requests again"),
                       ("remove", "drain a worker, then end it")):
        action = actions.add_parser(name, help=text)
        action.add_argument("worker_id")
    planner = actions.add_parser("planner", help="the SLO planner's signals and recent "
                                 "decisions (serve --autoscale); pause or resume it")
    planner.add_argument("verb", nargs="?", choices=("show", "pause", "resume"),
                         default="show")
    role = actions.add_parser("role", help="drain a worker and switch its role")
    role.add_argument("worker_id")
    role.add_argument("role", choices=ROLES)
    admin.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    method, path, body = _request(args)
    request = urllib.request.Request(
        args.url.rstrip("/") + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json",
                 **({"Authorization": f"Bearer {args.admin_api_key}"}
                    if args.admin_api_key else {})})
    context = ssl.create_default_context(cafile=args.cafile) if args.cafile else None
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=context) as reply:
            print(json.dumps(json.loads(reply.read()), indent=2))
            return 0
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        hint = " (is the admin API on? pdserve serve --admin-api-key)" \
            if err.code == 404 and args.action == "list" else ""
        print(f"pdserve admin: {err.code}: {message}{hint}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, TimeoutError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):  # it answered nothing in time: not unreachable
            print(f"pdserve admin: {args.url} gave no answer within {args.timeout:g}s "
                  "(the operation may still be under way: see `pdserve admin list`)",
                  file=sys.stderr)
        else:
            print(f"pdserve admin: cannot reach {args.url}: {reason}", file=sys.stderr)
        return 1


def _request(args: argparse.Namespace) -> tuple[str, str, dict | None]:
    worker = f"/admin/workers/{getattr(args, 'worker_id', '')}"
    return {"list": ("GET", "/admin/workers", None),
            "add": ("POST", "/admin/workers", {"role": getattr(args, "role", None),
                                               "wait": getattr(args, "wait", False)}),
            "show": ("GET", worker, None),
            "drain": ("POST", f"{worker}/drain", None),
            "resume": ("POST", f"{worker}/resume", None),
            "role": ("POST", f"{worker}/role", {"role": getattr(args, "role", None)}),
            "remove": ("DELETE", worker, None),
            "planner": (("GET", "/admin/planner", None) if getattr(args, "verb", "show")
                        == "show" else ("POST", f"/admin/planner/{args.verb}", None))
            }[args.action]
