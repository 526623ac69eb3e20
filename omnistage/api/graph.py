"""The stage graph as a mapping of stage -> the stages it reads from: cycles, order, reachability."""

from __future__ import annotations

from typing import Mapping


def find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """A cycle in a graph of node -> its inputs, as a path in data-flow direction, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                return list(reversed(stack[stack.index(m):] + [m]))
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def topo_order(graph: Mapping[str, list[str]]) -> list[str]:
    """Every node after the nodes it reads from; ties keep the graph's order."""
    done: list[str] = []
    remaining = list(graph)
    while remaining:
        for n in remaining:
            if all(m in done for m in graph[n]):
                done.append(n)
                remaining.remove(n)
                break
        else:  # pragma: no cover - validation refuses cycles before this runs
            raise ValueError("cycle")
    return done


def ancestors(graph: Mapping[str, list[str]], nodes: set[str]) -> set[str]:
    """`nodes` and every node they read from, directly or not."""
    seen = set(nodes)
    todo = list(nodes)
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen
