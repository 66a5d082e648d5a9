"""Fork a program into parallel branches that share the prompt's KV cache, then join."""

import sgl


@sgl.function
def tips(s, topic):
    s += "Here are two tips for " + topic + ": 1. Sleep well. 2. Drink water.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, explain tip {i + 1} in one sentence.\nTip {i + 1}:" + sgl.gen("detail", max_tokens=32, stop="\n")
    forks.join()
    s += "Tip 1:" + forks[0]["detail"] + "\nTip 2:" + forks[1]["detail"] + "\n"
    s += "In summary," + sgl.gen("summary", max_tokens=32, stop="\n")


if __name__ == "__main__":
    engine = sgl.Engine()
    state = tips.run("staying healthy", backend=engine, temperature=0)
    print(state.text())
    print("details:", state["detail"])
    engine.shutdown()
