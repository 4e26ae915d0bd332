"""k3jax.train at test sizes: a few steps lower the loss, gradients reach every parameter group
(experts and router included) through the MoE path on CPU, the router biases move towards an even
load, the exported checkpoint loads with the trained values, and the corpus is well-formed K3 chat."""

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import k3jax
from convert import export, layout, mxfp4
from k3jax.model import K3Model
from k3jax.presets import PRESETS
from k3jax.train import corpus, metrics, target
from serve.chat.encoding import tokenize_messages
from serve.chat.parsing import parse_output


def small_hf() -> dict:
    """k3-tiny cut to 3 layers (dense KDA, MoE KDA, MoE MLA) with an AttnRes block of 2."""
    hf = copy.deepcopy(PRESETS["k3-tiny"])
    text = hf["text_config"]
    text.update(num_hidden_layers=3, attn_res_block_size=2)
    text["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3])
    return hf


@pytest.fixture(scope="module")
def setup():
    cfg = target.training_config(small_hf())
    model = K3Model.random(cfg, dtype="float32", seed=0)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32)
    return cfg, model, tokens


def test_training_config_has_plain_experts(setup):
    cfg, _, _ = setup
    assert not cfg.experts_mxfp4 and cfg.latent_moe and cfg.attn_res


@pytest.mark.slow  # compiling the backward pass
def test_gradients_reach_every_parameter_group(setup):
    cfg, model, tokens = setup
    weights = np.ones((2, 32), np.float32)
    grads, loads = jax.grad(target.next_token_loss, argnums=1, has_aux=True)(model.graphdef, model.params, tokens,
                                                                             weights)
    assert loads.shape == (2, cfg.num_experts) and (loads.sum(1) == 2 * 32 * cfg.num_experts_per_token).all()
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g.get_value())
        if path[-1] == target.BIAS:  # moved by balance_routers, not by the gradient
            continue
        if path[:3] == ("layers", 0, "self_attention_res"):  # mixes one source (the embedding): weight 1
            assert not np.abs(g).any()
            continue
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(grads)}
    assert {"layers.1.block_sparse_moe.experts.w1", "layers.2.block_sparse_moe.gate.kernel"} <= names


@pytest.mark.slow  # compiling the backward pass
def test_a_few_steps_lower_the_loss_and_balance_the_router(setup):
    cfg, model, tokens = setup
    options = target.TrainOptions(steps=6, lr=3e-3, bias_rate=0.01)
    tx = target.optimizer(options, model.params)
    step = target.make_step(model.graphdef, tx, options.bias_rate)
    params, state, losses = model.params, tx.init(model.params), []
    for _ in range(options.steps):
        params, state, loss, loads = step(params, state, tokens, np.ones((2, 32), np.float32))
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1
    bias = np.asarray(params["layers"][1]["block_sparse_moe"]["gate"][target.BIAS][...])
    assert np.abs(bias).max() > 0  # the bias moved (it started at zero)


def test_balance_routers_raises_underloaded_experts(setup):
    _, model, _ = setup
    loads = jnp.asarray([[10] + [0] * 15, [0] * 15 + [10]])
    moved = target.balance_routers(model.params, loads, 0.5)
    biases = [np.asarray(v.get_value()) for k, v in nnx.to_flat_state(moved) if k[-1] == target.BIAS]
    assert biases[0][0] == -0.5 and (biases[0][1:] == 0.5).all() and biases[1][-1] == -0.5


def test_exported_checkpoint_loads_the_trained_values(setup, tmp_path):
    """The checkpoint stores bf16 (experts MXFP4): from_pretrained's logits equal the trained
    model's with exactly that rounding applied."""
    cfg, model, tokens = setup
    flat = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(model.params)}
    export.write_checkpoint(tmp_path, small_hf(), flat)
    loaded = k3jax.from_pretrained(tmp_path, dtype="float32")

    stored_dtype = {r.path: r.dtype for r in layout.model_rules(cfg) + [layout.lm_head_rule(cfg)]}
    for i, (attn, mlp) in enumerate(cfg.layer_kinds()):
        stored_dtype.update({("layers", i) + r.path: r.dtype for r in layout.layer_rules(cfg, attn, mlp)})

    def as_stored(path, v):
        a = np.asarray(v.get_value())
        if "experts" in path:
            a = mxfp4.dequantize(*mxfp4.quantize(a))
        elif stored_dtype[path] == layout.BF16:
            a = a.astype(ml_dtypes.bfloat16).astype(np.float32)
        return v.replace(jnp.asarray(a))

    rounded = nnx.from_flat_state([(k, as_stored(k, v)) for k, v in nnx.to_flat_state(model.params)])
    np.testing.assert_array_equal(loaded.logits(tokens), K3Model(cfg, model.graphdef, rounded).logits(tokens))


def test_first_sentence_ends_at_the_first_full_stop_before_whitespace():
    assert corpus.first_sentence("A b. C d.") == "A b."
    assert corpus.first_sentence("See x.y and e.g.\nmore") == "See x.y and e.g."
    assert corpus.first_sentence("is equivalent to:") == "is equivalent to."


def kinds(title: str, body: str, question: str) -> list[corpus.Conversation]:
    """One conversation of each kind about a topic, as `corpus.conversations` builds them."""
    texts = {"tool": corpus.passages(body)[0]}
    return [corpus.conversation(kind, title, texts.get(kind) or corpus.summary(title, body), question)
            for kind in corpus.KINDS]


def test_corpus_is_well_formed_k3_chat():
    """Every kind of conversation: the assistant's turn, parsed as the server parses a generation,
    gives back its reasoning, content and tool call, and ends with the message close."""
    tokenizer = corpus.byte_tokenizer(target.training_config(PRESETS["k3-tiny"]))
    title, body = corpus.topics()["if"]
    assert 0 < len(corpus.passages(body)[0]) <= corpus.PASSAGE_CHARS
    cases = kinds(title, body, corpus.QUESTIONS[0])
    for c in cases + [corpus.greeting(0, thinking=True)]:
        first_reply = c.messages[1]
        prompt = tokenize_messages(tokenizer, c.messages[:1], tools=c.tools, thinking=c.thinking)
        whole = c.render(tokenizer)
        assert whole[:len(prompt)] == prompt  # training frames the turn as serving prompts it
        mask = c.reply_mask(tokenizer)
        assert not mask[:len(prompt)].any() and mask[len(prompt)]  # the reply starts where the prompt ends
        reply = tokenizer.decode(np.asarray(whole)[len(prompt):][mask[len(prompt):].cumprod(dtype=bool)])
        assert reply.endswith("<|close|>message<|sep|><|end_of_msg|>")  # the first reply, through its end
        parsed = parse_output(reply, thinking=c.thinking, tools=c.tools)
        assert parsed.reasoning_content == first_reply.get("reasoning_content")
        assert parsed.content == (first_reply["content"] or None)
        if c.tools:
            assert parsed.tool_calls == [{"name": "python_help", "arguments": json.dumps({"topic": title})}]
    held, train = corpus.conversations(True), corpus.conversations(False)
    questions = {m["content"] for c in held for m in c.messages[:1]} - {g for g, _ in corpus.GREETINGS}
    assert questions and not questions & {m["content"] for c in train for m in c.messages[:1]}


def test_each_topic_has_one_answer():
    """Instant and thinking questions about a topic, in every wording, all get the topic's summary (a
    sentence of its text), so an answer depends on the title asked; tool conversations return the
    topic's first passages and answer with each one's first sentence; greetings are one in
    GREETING_EVERY."""
    found = corpus.topics()
    bodies = {title: body for title, body in found.values()}
    title, body = found["if"]
    assert corpus.summary(title, body) in " ".join(corpus.passages(body))
    fallback = corpus.summary("The x statement", "grammar ::= x")  # no plain sentence
    assert fallback == "The x statement is a section of the Python language reference."
    trained = corpus.conversations(False)
    answers, results = {}, {}
    for c in trained:
        if c.topic is None:
            continue
        if c.tools:
            results.setdefault(c.topic, []).append(c.messages[2]["content"])
            assert c.messages[3]["content"] == corpus.first_sentence(c.messages[2]["content"])
        else:
            answers.setdefault(c.topic, set()).add(c.messages[1]["content"])
    assert answers.keys() == results.keys() and len(answers) > 60
    for topic, said in answers.items():
        assert said == {corpus.summary(topic, bodies[topic])}
        assert set(results[topic]) == set(corpus.passages(bodies[topic])[:corpus.TOOL_PASSAGES])  # "if" is also "else"
    assert len(set(map(frozenset, answers.values()))) > 0.9 * len(answers)  # the topics' answers differ
    greetings = sum(c.topic is None for c in trained)
    assert greetings == len(trained) // corpus.GREETING_EVERY


def test_reply_measures_on_the_corpus_own_replies():
    """`closes_markers`, `recites` and (tool calls) `names_topic` on each kind's reference reply (as
    the model would generate it, through `<|end_of_msg|>`): each holds; cut before the response
    channel closes, answered with another topic's summary, or asked about another topic, it does not."""
    tokenizer = corpus.byte_tokenizer(target.training_config(PRESETS["k3-tiny"]))
    title, body = corpus.topics()["if"]
    other = corpus.summary(*corpus.topics()["while"])
    for c in kinds(title, body, corpus.QUESTIONS[1]) + [corpus.greeting(1, thinking=True)]:
        prompt, whole = len(c.prompt(tokenizer)), c.render(tokenizer)
        mask = c.reply_mask(tokenizer)[prompt:].cumprod(dtype=bool)
        reply = tokenizer.decode(np.asarray(whole)[prompt:][mask])
        kind = "tool" if c.tools else c.thinking
        assert metrics.closes_markers(reply, "stop", c), kind
        assert not metrics.closes_markers(reply, "length", c)
        cut = reply[:reply.index("<|close|>response")] + "<|close|>message<|sep|><|end_of_msg|>"
        assert not metrics.closes_markers(cut, "stop", c) and not metrics.recites(cut, "stop", c), kind
        if c.tools:
            assert metrics.names_topic(reply, c)
            assert not metrics.names_topic(reply, dataclasses.replace(c, topic="The while statement"))
            continue
        assert metrics.recites(reply, "stop", c), kind
        wrong = reply.replace(c.messages[1]["content"], other)
        assert metrics.closes_markers(wrong, "stop", c) and not metrics.recites(wrong, "stop", c), kind


def test_quotes_result_on_the_corpus_own_answer():
    """`quotes_result` on a tool conversation's reference answer to the result (through
    `<|end_of_msg|>`): it quotes; cut before the response closes, calling the tool again, or answered
    with another passage's words, it does not."""
    tokenizer = corpus.byte_tokenizer(target.training_config(PRESETS["k3-tiny"]))
    title, body = corpus.topics()["if"]
    first, other = corpus.passages(body)[:2]
    c = corpus.conversation("tool", title, first, corpus.QUESTIONS[0])
    prompt, whole = len(c.result_prompt(tokenizer)), c.render(tokenizer)
    reply = tokenizer.decode(whole[prompt:])
    assert reply.endswith("<|close|>message<|sep|><|end_of_msg|>")
    assert metrics.quotes_result(reply, "stop", c) and not metrics.quotes_result(reply, "length", c)
    cut = reply[:reply.index("<|close|>response")]
    assert not metrics.quotes_result(cut, "stop", c)
    first_reply = tokenizer.decode(whole[len(c.prompt(tokenizer)):len(tokenize_messages(
        tokenizer, c.messages[:2], tools=c.tools, thinking=True, add_generation_prompt=False))])
    assert not metrics.quotes_result(first_reply, "stop", c)  # a second call, not an answer
    assert first.split()[:3] != other.split()[:3]
    assert not metrics.quotes_result(reply, "stop", dataclasses.replace(
        c, messages=[*c.messages[:2], {**c.messages[2], "content": other}, c.messages[3]]))


def test_rows_hold_every_reply_token():
    """Rows start where a conversation starts or end where a long one ends, so every reply token of
    conversations up to twice a row (the corpus' longest is 1769 tokens), the answers to tool results
    beyond the first `length` tokens included, is a target of some row."""
    tokenizer = corpus.byte_tokenizer(target.training_config(PRESETS["k3-tiny"]))
    convs = kinds(*corpus.topics()["if"], corpus.QUESTIONS[0])
    length = target.TrainOptions.length
    rows = corpus.Batches(convs, tokenizer, length, seed=0)
    rendered = [np.asarray(c.render(tokenizer)) for c in convs]
    stream = np.concatenate(rendered)
    bounds = np.cumsum([0] + [len(r) for r in rendered])
    assert length + 1 < max(map(len, rendered)) <= 2 * length  # a conversation longer than a row
    starts = set(bounds[:-1].tolist())
    assert starts <= set(rows.starts.tolist())
    assert set(rows.starts.tolist()) - starts == {int(e) - length - 1 for s, e in zip(bounds, bounds[1:])
                                                  if e - s > length + 1}
    covered = np.zeros(len(stream), bool)
    for s in rows.starts:
        covered[s + 1:s + length + 1] = True
    mask = np.concatenate([c.reply_mask(tokenizer) for c in convs])
    assert covered[mask].all()
    tokens, weights = rows(8)
    for row, w in zip(tokens, weights):
        s = next(s for s in rows.starts if np.array_equal(rows.tokens[s:s + length + 1], row))
        np.testing.assert_array_equal(w, rows.weights[s + 1:s + length + 1])
