"""In-tree model architectures, registered through the plugin hook like any third-party one."""

from plinth.hookspecs import hookimpl

PLINTH_PLUGIN_API = "1.0"

_M = "plinth.model_registry.models"


@hookimpl
def plinth_models() -> dict[str, str]:
    return {
        "LlamaForCausalLM": f"{_M}.llama:LlamaForCausalLM",
        "MistralForCausalLM": f"{_M}.llama:MistralForCausalLM",
        "Qwen2ForCausalLM": f"{_M}.qwen2:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": f"{_M}.qwen3:Qwen3ForCausalLM",
        "MixtralForCausalLM": f"{_M}.mixtral:MixtralForCausalLM",
        "Qwen3MoeForCausalLM": f"{_M}.qwen3_moe:Qwen3MoeForCausalLM",
        "GemmaForCausalLM": f"{_M}.gemma:GemmaForCausalLM",
        "Gemma2ForCausalLM": f"{_M}.gemma:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": f"{_M}.gemma:Gemma3ForCausalLM",
        "Phi3ForCausalLM": f"{_M}.phi3:Phi3ForCausalLM",
        "SmolLM3ForCausalLM": f"{_M}.smollm3:SmolLM3ForCausalLM",
        "Llama4ForCausalLM": f"{_M}.llama4:Llama4ForCausalLM",
        "GraniteForCausalLM": f"{_M}.granite:GraniteForCausalLM",
        "Olmo2ForCausalLM": f"{_M}.olmo2:Olmo2ForCausalLM",
        "Olmo3ForCausalLM": f"{_M}.olmo2:Olmo3ForCausalLM",
        "GptOssForCausalLM": f"{_M}.gpt_oss:GptOssForCausalLM",
        "Qwen2MoeForCausalLM": f"{_M}.qwen2_moe:Qwen2MoeForCausalLM",
        "OlmoeForCausalLM": f"{_M}.qwen2_moe:OlmoeForCausalLM",
        "GraniteMoeForCausalLM": f"{_M}.granite:GraniteMoeForCausalLM",
        "GraniteMoeSharedForCausalLM": f"{_M}.granite:GraniteMoeForCausalLM",
        "GraniteMoeHybridForCausalLM": f"{_M}.granite_hybrid:GraniteMoeHybridForCausalLM",
        "NemotronHForCausalLM": f"{_M}.nemotron_h:NemotronHForCausalLM",
        "Mamba2ForCausalLM": f"{_M}.nemotron_h:Mamba2ForCausalLM",
        "MambaForCausalLM": f"{_M}.nemotron_h:MambaForCausalLM",
        "FalconMambaForCausalLM": f"{_M}.nemotron_h:FalconMambaForCausalLM",
        "JambaForCausalLM": f"{_M}.jamba:JambaForCausalLM",
        "Qwen3NextForCausalLM": f"{_M}.qwen3_next:Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM": f"{_M}.qwen3_next:Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM": f"{_M}.qwen3_next:Qwen3_5MoeForCausalLM",
        "FalconH1ForCausalLM": f"{_M}.falcon_h1:FalconH1ForCausalLM",
        "DeepseekV2ForCausalLM": f"{_M}.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": f"{_M}.deepseek:DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM": f"{_M}.glm4_moe:Glm4MoeForCausalLM",
        "Dots1ForCausalLM": f"{_M}.glm4_moe:Dots1ForCausalLM",
        "MinistralForCausalLM": f"{_M}.llama:MinistralForCausalLM",
        "SeedOssForCausalLM": f"{_M}.llama:SeedOssForCausalLM",
        "Ernie4_5ForCausalLM": f"{_M}.ernie:Ernie4_5ForCausalLM",
        "Ernie4_5_MoeForCausalLM": f"{_M}.ernie:Ernie4_5_MoeForCausalLM",
        "CohereForCausalLM": f"{_M}.cohere:CohereForCausalLM",
        "Cohere2ForCausalLM": f"{_M}.cohere:Cohere2ForCausalLM",
        "StableLmForCausalLM": f"{_M}.stablelm:StableLmForCausalLM",
        "PhiForCausalLM": f"{_M}.phi:PhiForCausalLM",
        # encoder-only models: embeddings (task "embed") and classifiers (task "classify")
        "BertModel": f"{_M}.bert:BertModel",
        "BertForSequenceClassification": f"{_M}.bert:BertModel",
        "BertForTokenClassification": f"{_M}.bert:BertModel",
        "RobertaModel": f"{_M}.bert:BertModel",
        "RobertaForSequenceClassification": f"{_M}.bert:BertModel",
        "RobertaForTokenClassification": f"{_M}.bert:BertModel",
        "XLMRobertaModel": f"{_M}.bert:BertModel",
        "XLMRobertaForSequenceClassification": f"{_M}.bert:BertModel",
        "XLMRobertaForTokenClassification": f"{_M}.bert:BertModel",
        "ModernBertModel": f"{_M}.modernbert:ModernBertModel",
        "ModernBertForSequenceClassification": f"{_M}.modernbert:ModernBertModel",
        "ModernBertForTokenClassification": f"{_M}.modernbert:ModernBertModel",
    }
