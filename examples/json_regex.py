"""Structured output: a JSON object built from regex-constrained gens inside a var_scope,
and the same object produced in one gen from a JSON Schema."""

import json

import sgl

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,  # without it a small model may ramble on past max_tokens
}


@sgl.function
def city_regex(s, city):
    s += "Write a JSON description of " + city + ".\n"
    with s.var_scope("json"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string(max_tokens=16) + ",\n"
        s += '  "country": ' + sgl.gen_string(max_tokens=16) + ",\n"
        s += '  "population": ' + sgl.gen(regex=r"[0-9]{1,9}", max_tokens=10) + ",\n"
        s += '  "ip_of_city_hall": ' + sgl.gen(
            regex=r'"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"', max_tokens=20) + "\n"
        s += "}"


@sgl.function
def city_schema(s, city):
    s += sgl.user("Describe " + city + " as JSON with its name and population.")
    s += sgl.assistant(sgl.gen("json", json_schema=json.dumps(SCHEMA), max_tokens=64))


if __name__ == "__main__":
    engine = sgl.Engine()
    sgl.set_default_backend(engine)
    state = city_regex.run("Paris", temperature=0)
    print(json.dumps(json.loads(state["json"]), indent=2))
    state = city_schema.run("Tokyo", temperature=0)
    print(json.loads(state["json"]))
    engine.shutdown()
