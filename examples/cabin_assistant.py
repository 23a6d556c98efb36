"""A car cabin's quick decisions with the Python API: window, air conditioning and a driver warning decided
together from the cabin's state and the car's rules, in one denoising pass (`Engine.decide`).

    python examples/cabin_assistant.py                    # the bundled model (a toy: its answers are noise)
    python examples/cabin_assistant.py --model DIR        # a model that knows the domain

Each answer is always one of its options, whatever the model: the engine restricts every question's tokens to
its options, so the caller can act on the result without parsing free text. `confidence` says how sure the
decision was (the answer's share of its options' probability); a low one can fall back to a safe default.
"""

from __future__ import annotations

import argparse

import clover_lite

RULES = (
    "Close the window when it rains or above 100 km/h. "
    "Turn the air conditioning on above 26 C inside, off below 18 C. "
    "Warn the driver after two hours of driving or when the eyes close for over a second."
)
QUESTIONS = {
    "window": ["open", "closed"],
    "air conditioning": ["on", "off"],
    "driver warning": ["none", "take a break", "pull over now"],
}


def cabin_context(state: dict) -> str:
    return "cabin: " + ", ".join(f"{k} {v}" for k, v in state.items()) + ". rules: " + RULES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    engine = clover_lite.load(args.model, device=args.device)
    state = {"inside": "29 C", "rain": "yes", "speed": "70 km/h", "driving": "2 h 10 min", "eyes closed": "0.2 s"}
    context = cabin_context(state)
    print(context, "\n")
    engine.decide(context, QUESTIONS)  # warm-up: the first call pays one-time costs
    joint = engine.decide(context, QUESTIONS)
    for name, answer in joint.answers.items():
        sure = joint.confidence[name]
        action = answer if sure >= 0.8 else f"{answer} (unsure: {sure:.0%}, keep the current setting)"
        print(f"{name:>17}: {action}")
    sequential = engine.decide(context, QUESTIONS, mode="sequential")
    print(f"\njoint: {joint.forwards} forwards, {joint.seconds * 1000:.0f} ms; one question after another: "
          f"{sequential.forwards} forwards, {sequential.seconds * 1000:.0f} ms")


if __name__ == "__main__":
    main()
