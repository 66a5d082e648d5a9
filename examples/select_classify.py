"""Classification with select(): every label is scored in one batched call on the cached prefix.
Shows the three choice methods side by side."""

import sgl

LABELS = [" positive", " negative", " neutral"]


@sgl.function
def classify(s, review, method):
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    s += "Review: I loved every minute of it.\nSentiment: positive\n"
    s += "Review: The food was cold and the staff rude.\nSentiment: negative\n"
    s += "Review: The meeting is at 3pm in room 4.\nSentiment: neutral\n"
    s += "Review: Best purchase I have made this year!\nSentiment: positive\n"
    s += "Review: It stopped working after a week. Awful.\nSentiment: negative\n"
    s += "Review: " + review + "\nSentiment:"
    s += sgl.select("label", choices=LABELS, choices_method=method)


if __name__ == "__main__":
    engine = sgl.Engine()
    sgl.set_default_backend(engine)
    reviews = ["What a fantastic film, I would watch it again!", "Terrible service, never again.",
               "The package arrived on Tuesday."]
    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        states = classify.run_batch([{"review": r, "method": method} for r in reviews])
        print(f"{method!r}:")
        for r, st in zip(reviews, states):
            print(f"  {st['label'].strip():9s} <- {r}")
    engine.shutdown()
