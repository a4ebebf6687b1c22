"""/v1/embeddings (mesh/front/embeddings_api.py) as the openai SDK and LangChain's
OpenAIEmbeddings call it: each input's final hidden rows from the last stage, pooled and
L2-normalized; the same bits with the caches on or off, batched or alone, as floats or
base64; and close to llama.cpp's own embeddings of the same file (its independent
numeric reference). Real uvicorn on loopback: run inside a loopback-only network
namespace."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from openai_schemas import conforms

from skippy.cache.config import CacheConfig
from skippy.mesh.control.local import InProcessEngine
from skippy.mesh.front.gateway import BackgroundServer, create_app

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Rivers carry sediment to the sea.",
         "A good night's sleep helps memory."]


def serving(path, cache: bool):
    engine = InProcessEngine(path, 2, cache=CacheConfig(enabled=cache), n_ctx=512,
                             model_name="smollm2", weight_format="int4")
    return BackgroundServer(create_app(engine, api_keys=()))


@pytest.fixture(scope="module")
def clients(smollm2):
    with serving(smollm2, True) as on, serving(smollm2, False) as off:
        yield [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
               for s in (on, off)]


def vectors(client, inputs, **kw) -> np.ndarray:
    out = client.embeddings.create(model="smollm2", input=inputs, **kw)
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return np.array([d.embedding for d in out.data], dtype=np.float32)


def test_the_same_bits_cached_or_not_batched_or_alone(clients):
    on, off = clients
    batch = vectors(on, TEXTS)
    assert batch.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1, rtol=1e-5)
    again = vectors(on, TEXTS)  # the prompts' state is now cached: unused, same bits
    alone = np.concatenate([vectors(on, t) for t in TEXTS])
    cold = vectors(off, TEXTS)
    assert (batch == again).all() and (batch == alone).all() and (batch == cold).all()
    raw = on.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="base64")
    assert (np.frombuffer(base64.b64decode(raw.data[0].embedding), np.float32)
            == batch[0]).all()


def test_close_to_llama_cpps_embeddings_in_both_poolings(clients, smollm2):
    import llama_cpp
    on, _ = clients
    for pooling, kind in (("mean", llama_cpp.LLAMA_POOLING_TYPE_MEAN),
                          ("last", llama_cpp.LLAMA_POOLING_TYPE_LAST)):
        reference = llama_cpp.Llama(str(smollm2), embedding=True, pooling_type=kind, n_ctx=256,
                                    n_threads=2, verbose=False)
        try:
            want = np.array(reference.embed(TEXTS, normalize=True), dtype=np.float32)
        finally:
            reference.close()
        got = vectors(on, TEXTS, extra_body={"pooling": pooling})
        cosines = (got * want).sum(axis=1)
        assert cosines.min() > 0.995, (pooling, cosines)  # int4 weights against Q4_1
    assert not (vectors(on, TEXTS[0]) == vectors(on, TEXTS[0],
                                                 extra_body={"pooling": "last"})).all()


def test_the_body_is_openais_published_shape(clients):
    import httpx
    body = httpx.post(str(clients[0].base_url).rstrip("/") + "/embeddings", timeout=60,
                      json={"model": "smollm2", "input": TEXTS[:2]}).json()
    conforms("CreateEmbeddingResponse", body)


def test_token_ids_embed_as_their_text_does(clients, smollm2):
    from skippy.mesh.tokenizer import Tokenizer
    on, _ = clients
    ids = Tokenizer(smollm2).encode(TEXTS[1])
    assert (vectors(on, [ids]) == vectors(on, TEXTS[1])).all()
    usage = on.embeddings.create(model="smollm2", input=[ids, ids]).usage
    assert usage.prompt_tokens == usage.total_tokens == 2 * len(ids)


@pytest.mark.parametrize(("kw", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[1, 10**9]]}, "input"),
    ({"input": "x " * 600}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "extra_body": {"pooling": "cls"}}, "pooling")])
def test_what_cannot_be_embedded_is_a_400_naming_its_field(clients, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        clients[0].embeddings.create(model="smollm2", **kw)
    assert e.value.param == param


def test_langchain_embeds_documents_and_queries(clients):
    from langchain_openai import OpenAIEmbeddings
    on, _ = clients
    # no tiktoken: the server counts its own tokens (tiktoken would fetch its tables)
    lc = OpenAIEmbeddings(model="smollm2", base_url=str(on.base_url), api_key="x",
                          check_embedding_ctx_length=False, max_retries=0)
    docs = np.array(lc.embed_documents(TEXTS), dtype=np.float32)
    assert (docs == vectors(on, TEXTS)).all()
    assert np.allclose(lc.embed_query(TEXTS[2]), docs[2])
