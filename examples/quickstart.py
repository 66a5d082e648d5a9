"""Quickstart: an SGLang program on the embedded model, in-process (`make demo`).

Shows a chat answer, a few-shot completion, streaming, a small run_batch, and the
engine's prefix-cache statistics. Programs are written exactly as for SGLang.
"""

import sgl


@sgl.function
def chat(s, question):
    s += sgl.system("You are a helpful assistant. Answer in one sentence.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=48))


@sgl.function
def capital(s, country):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n"
    s += "Q: What is the capital of " + country + "?\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=8)


def main() -> None:
    engine = sgl.Engine()
    sgl.set_default_backend(engine)

    print("== chat ==")
    state = chat.run("Why is the sky blue?", temperature=0)
    print(state["answer"])

    print("\n== few-shot completion ==")
    state = capital.run("Japan", temperature=0)
    print("Japan ->", state["answer"].strip())

    print("\n== streaming ==")
    state = chat.run("Name three fruits.", temperature=0, stream=True)
    for piece in state.text_iter("answer"):
        print(piece, end="", flush=True)
    print()

    print("\n== run_batch ==")
    countries = ["the United Kingdom", "China", "Spain", "Egypt"]
    states = capital.run_batch([{"country": c} for c in countries], temperature=0)
    for c, st in zip(countries, states):
        print(f"{c} -> {st['answer'].strip()}")

    print("\n== cache statistics ==")
    info = sgl.get_server_info()
    print(f"prompt tokens: {info['prompt_tokens_total']}, served from cache: {info['cached_tokens_total']}, "
          f"hit rate: {info['cache_hit_rate']:.1%}")
    engine.shutdown()


if __name__ == "__main__":
    main()
