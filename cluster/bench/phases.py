"""The bench's view of ``engine.phase_timers``: one line per step kind of a load's phases."""


def format_phases(label: str, phases: dict, top: int = 8) -> str:
    """One line per step kind: its steps, ms per step and the largest phases."""
    lines = []
    for kind, p in phases.items():
        parts = ", ".join(f"{n} {ms:.3f}" for n, ms in list(p["phases_ms_per_step"].items())[:top])
        lines.append(f"{label} {kind}: {p['steps']} steps, {p['ms_per_step']:.3f} ms/step: {parts}")
    return "\n".join(lines)
