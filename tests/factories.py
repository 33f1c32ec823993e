"""factory_boy factories for the durable records."""

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from nodes.models import Node
from sessions.models import Generation, GrammarHandle, InferenceSession, LogitBiasHandle, Message


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    is_staff = True
    is_superuser = True
    password = factory.django.Password("pw-123456")


class NodeFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Node

    identity = factory.Sequence(lambda n: f"gpu-{n}")
    models_served = factory.LazyFunction(lambda: ["smollm2"])
    lanes = 8
    context_window = 2048
    state = Node.State.ONLINE
    address = "10.0.0.7"
    engine = "llama.cpp 0.3.36"
    last_seen_at = factory.LazyFunction(timezone.now)
    joined_at = factory.LazyFunction(timezone.now)


class SessionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = InferenceSession

    model = "smollm2"
    title = factory.Sequence(lambda n: f"chat {n}")


class MessageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Message

    session = factory.SubFactory(SessionFactory)
    index = factory.Sequence(lambda n: n)
    role = "user"
    content = "hello"


class GenerationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Generation

    model = "smollm2"
    node = factory.SubFactory(NodeFactory)
    status = Generation.Status.DONE
    finish_reason = "stop"
    prompt_tokens = 20
    completion_tokens = 10
    created_at = factory.LazyFunction(timezone.now)


class GrammarHandleFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GrammarHandle

    kind = GrammarHandle.Kind.GBNF
    source = 'root ::= "yes" | "no"'


class LogitBiasHandleFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = LogitBiasHandle

    bias = factory.LazyFunction(lambda: {"42": -100})
