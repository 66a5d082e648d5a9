"""Tool use (ReAct style): the model writes a calculator call, the program runs it and
feeds the result back, and the model answers from it."""

import re

import sgl


def calculator(expr: str) -> str:
    if not re.fullmatch(r"[0-9+\-*/ ().]+", expr):
        return "error: only arithmetic is allowed"
    return str(eval(expr))  # noqa: S307 - restricted to digits and operators above


@sgl.function
def react(s, question):
    s += "Answer questions using the calculator: write calc(<expression>), then read the result.\n\n"
    s += "Question: What is 12 times 3?\nAction: calc(12 * 3)\nObservation: 36\nAnswer: 36\n\n"
    s += "Question: What is 7 plus 8?\nAction: calc(7 + 8)\nObservation: 15\nAnswer: 15\n\n"
    s += "Question: " + question + "\nAction: calc(" + sgl.gen("expr", stop=")", max_tokens=16) + ")\n"
    s += "Observation: " + calculator(s["expr"]) + "\n"
    s += "Answer:" + sgl.gen("answer", stop="\n", max_tokens=8)


if __name__ == "__main__":
    engine = sgl.Engine()
    for q in ["What is 25 times 4?", "What is 100 minus 58?"]:
        state = react.run(q, backend=engine, temperature=0)
        print(f"{q} -> calc({state['expr']}) -> {state['answer'].strip()}")
    engine.shutdown()
