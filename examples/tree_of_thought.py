"""Tree of thought: propose several approaches in parallel forks, judge each, then pick
the best with select(). All branches reuse the question's cached KV."""

import sgl


@sgl.function
def tree_of_thought(s, question, width=3):
    s += "Question: " + question + "\n"
    thoughts = s.fork(width)
    thoughts += lambda i: f"Approach {i + 1}:" + sgl.gen("plan", max_tokens=32, stop="\n")
    judges = [t.fork(1)[0] for t in thoughts]
    for j in judges:
        j += "\nIs this approach sound? Answer: " + sgl.select("verdict", ["yes", "no"])
    thoughts.join()
    verdicts = [j["verdict"] for j in judges]
    s += "".join(f"Approach {i + 1}:{p} ({v})\n" for i, (p, v) in enumerate(zip(s["plan"], verdicts)))
    s += "The best approach is number " + sgl.select("best", [str(i + 1) for i in range(width)]) + ".\n"
    s += "Final answer:" + sgl.gen("answer", max_tokens=32, stop="\n")


if __name__ == "__main__":
    engine = sgl.Engine()
    state = tree_of_thought.run("How can I save money on groceries?", backend=engine, temperature=0)
    print(state.text())
    info = engine.get_server_info()
    print(f"cache hit rate: {info['cache_hit_rate']:.1%}")
    engine.shutdown()
