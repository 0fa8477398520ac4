"""The model registry: Hugging Face architecture name -> model class, resolved lazily.

Architectures come from three places, highest precedence first:

1. :meth:`ModelRegistryImpl.register_model` calls (``plinth.ModelRegistry.register_model(...)``);
2. plugins' ``plinth_models`` hook (in-tree models are registered the same way);
3. the transformers fallback, for any causal-LM architecture transformers implements.

An architecture found in none of them raises :class:`~plinth.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import threading

from plinth.errors import UnsupportedModelError
from plinth.plugins import PluginError, get_plugin_manager, resolve_ref


class ModelRegistryImpl:
    """Lookup of model classes by architecture name. Use the module-level :data:`ModelRegistry`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._user: dict[str, str | type] = {}

    def register_model(self, architecture: str, model: str | type) -> None:
        """Register (or replace) an architecture.

        Args:
            architecture: the name in ``config.json``'s ``architectures`` list.
            model: a :class:`~plinth.model_registry.interface.CausalLM` subclass, or a lazy
                reference ``"package.module:Class"`` imported on first use.

        Raises:
            ValueError: ``model`` is neither a class nor a ``"module:Class"`` string.
        """
        if isinstance(model, str):
            module, sep, attr = model.partition(":")
            if not (module and sep and attr):
                raise ValueError(f"invalid model reference {model!r}: expected 'package.module:Class'")
        elif not isinstance(model, type):
            raise ValueError(f"register_model needs a class or a 'package.module:Class' string, got {model!r}")
        with self._lock:
            self._user[architecture] = model

    def unregister_model(self, architecture: str) -> None:
        """Remove a registration made with :meth:`register_model` (plugin ones stay)."""
        with self._lock:
            self._user.pop(architecture, None)

    def user_registrations(self) -> dict[str, str | type]:
        """The :meth:`register_model` registrations, to hand to worker processes (which start with none).

        Raises:
            ConfigError: a registered class cannot be pickled (defined inside a function, say), so worker
                processes could not build it.
        """
        import pickle

        from plinth.config import ConfigError

        with self._lock:
            user = dict(self._user)
        for architecture, model in user.items():
            if isinstance(model, type):
                try:
                    pickle.dumps(model)
                except Exception as exc:  # noqa: BLE001 - pickling a class fails with many types
                    raise ConfigError(
                        f"the model class registered for {architecture!r} ({model.__qualname__}) cannot be sent to "
                        f"worker processes ({type(exc).__name__}: {exc}); define it at the top level of a module, "
                        f"or register it as 'package.module:Class'") from None
        return user

    def set_user_registrations(self, registrations: dict[str, str | type]) -> None:
        """Replace every :meth:`register_model` registration (a worker process takes the driver's)."""
        with self._lock:
            self._user = dict(registrations)

    def _plugin_refs(self) -> dict[str, str]:
        return {name: reg.ref for name, reg in get_plugin_manager().registrations("models").items()}

    def supported_architectures(self) -> list[str]:
        """Natively implemented architectures (plugins and :meth:`register_model`), sorted."""
        with self._lock:
            user = set(self._user)
        return sorted(user | set(self._plugin_refs()))

    def is_native(self, architecture: str) -> bool:
        """Whether ``architecture`` has its own implementation (no transformers fallback)."""
        return architecture in self.supported_architectures()

    def resolve(self, architecture: str) -> type:
        """The model class of ``architecture``.

        Raises:
            UnsupportedModelError: neither plinth nor transformers implements it (the message
                lists the supported architectures), or its registration cannot be imported.
        """
        with self._lock:
            ref: str | type | None = self._user.get(architecture)
        if ref is None:
            ref = self._plugin_refs().get(architecture)
        if ref is None:
            cls = self._fallback(architecture)
        elif isinstance(ref, type):
            cls = ref
        else:
            try:
                cls = resolve_ref(ref)
            except PluginError as exc:
                raise UnsupportedModelError(f"architecture {architecture!r} is registered as {ref!r}, "
                                            f"but it cannot be loaded: {exc}") from exc
        if not isinstance(cls, type):
            raise UnsupportedModelError(f"architecture {architecture!r} resolves to {cls!r}, which is not a class")
        from plinth.model_registry.interface import CausalLM

        if not issubclass(cls, CausalLM):
            raise UnsupportedModelError(f"architecture {architecture!r} resolves to {cls.__module__}.{cls.__qualname__}, "
                                        "which is not a plinth.model_registry.interface.CausalLM subclass")
        return cls

    def _fallback(self, architecture: str) -> type:
        from plinth.model_registry.models import transformers_fallback

        if transformers_fallback.transformers_class(architecture) is not None:
            return transformers_fallback.fallback_class(architecture)
        raise UnsupportedModelError(
            f"model architecture {architecture!r} is not supported; plinth implements: "
            f"{', '.join(self.supported_architectures())}, and runs any causal-LM architecture "
            f"transformers knows through its fallback. Register your own with "
            f"plinth.ModelRegistry.register_model({architecture!r}, 'your_package.module:YourModel')"
        )

    def __repr__(self) -> str:
        return f"<ModelRegistry {len(self.supported_architectures())} architectures>"


#: The process-wide model registry (``plinth.ModelRegistry``).
ModelRegistry = ModelRegistryImpl()
