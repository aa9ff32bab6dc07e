"""The tool worker process:
``python -m rlmega.agent._tool_worker TASK_FD RESULT_FD '{"tools": [...], "memory_mb": m}'``.

It dies with the pool's process, limits its own address space (children inherit the limit), loads every tool,
answers ``("ready",)``, then reads tasks from TASK_FD: ``(task_id, "describe")`` gives the tools' schemas,
``(task_id, "call", name, arguments, context)`` runs a tool (``context`` goes to a tool that declares it);
answers on RESULT_FD are ``(task_id, "value", value)`` or ``(task_id, "error", message)``. The pool
(``rlmega.rewards.pool``) kills it, with whatever it started, when a call overruns.
"""

from __future__ import annotations

import json
import resource
import sys
from multiprocessing.connection import Connection

from rlmega.rewards._worker import die_with_parent, one_line, serve


def main(argv: list[str]) -> int:
    tasks = Connection(int(argv[1]), writable=False)
    results = Connection(int(argv[2]), readable=False)
    settings = json.loads(argv[3])
    die_with_parent()  # a killed trainer leaves no tool process behind
    try:
        limit = settings["memory_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        from rlmega.agent.builtin import BUILTIN_TOOLS
        from rlmega.agent.functions import load_callable
        from rlmega.agent.tools import CONTEXT, ToolError, as_output, schema_of, takes_context

        functions = [BUILTIN_TOOLS[spec] if spec in BUILTIN_TOOLS else load_callable(spec)
                     for spec in settings["tools"]]
        schemas = [schema_of(function) for function in functions]
        by_name = {schema["function"]["name"]: function for schema, function in zip(schemas, functions)}
        with_context = {name for name, function in by_name.items() if takes_context(function)}
    except BaseException as error:
        results.send(("failed", one_line(error)))
        return 1
    def answer(kind, *payload) -> tuple:
        if kind == "describe":
            return "value", schemas
        name, arguments, context = payload
        if name in with_context:
            arguments = {**arguments, CONTEXT: context}
        try:
            return "value", as_output(by_name[name](**arguments))
        except ToolError as error:
            return "error", str(error)
        except MemoryError:
            return "error", f"the tool ran out of memory (limit {settings['memory_mb']} MB)"

    return serve(tasks, results, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
