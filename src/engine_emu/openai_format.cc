#include "engine_emu/openai_format.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace eldr::engine_emu {

absl::StatusOr<SignatureKey> ParseSignatureKey(absl::string_view text) {
  if (text == "eldr_expert_counts") return SignatureKey::kEldrExpertCounts;
  if (text == "eldr_sig") return SignatureKey::kEldrSig;
  if (text == "both") return SignatureKey::kBoth;
  if (text == "none") return SignatureKey::kNone;
  return absl::InvalidArgumentError(
      absl::StrCat("--signature_key must be eldr_expert_counts, eldr_sig, both or none, got '", text, "'"));
}

absl::string_view FinishReasonName(FinishReason reason) { return reason == FinishReason::kLength ? "length" : "stop"; }

void AppendTokenText(int trace_index, int64_t k, std::string* out) { absl::StrAppend(out, " t", trace_index, "_", k); }

AnswerFormatter::AnswerFormatter(ApiKind api, absl::string_view request_id, int64_t created, absl::string_view model)
    : api_(api),
      full_id_(absl::StrCat(api == ApiKind::kChat ? "chatcmpl-" : "cmpl-", request_id)),
      created_(created),
      model_(model) {
  event_head_ = absl::StrCat("data: {\"id\":\"", JsonEscape(full_id_), "\",\"object\":\"",
                             api == ApiKind::kChat ? "chat.completion.chunk" : "text_completion",
                             "\",\"created\":", created_, ",\"model\":\"", JsonEscape(model_), "\",");
}

void AnswerFormatter::AppendTokenEvent(absl::string_view text, bool last, FinishReason reason, std::string* out) const {
  out->append(event_head_);
  if (api_ == ApiKind::kChat) {
    out->append("\"choices\":[{\"index\":0,\"delta\":{\"content\":\"");
    out->append(text.data(), text.size());
    out->append("\"},\"logprobs\":null,\"finish_reason\":");
  } else {
    out->append("\"choices\":[{\"index\":0,\"text\":\"");
    out->append(text.data(), text.size());
    out->append("\",\"logprobs\":null,\"finish_reason\":");
  }
  if (last) {
    out->push_back('"');
    const absl::string_view name = FinishReasonName(reason);
    out->append(name.data(), name.size());
    out->push_back('"');
  } else {
    out->append("null");
  }
  out->append("}]}\n\n");
}

void AnswerFormatter::AppendRoleEvent(std::string* out) const {
  out->append(event_head_);
  out->append(
      "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,"
      "\"finish_reason\":null}]}\n\n");
}

void AnswerFormatter::AppendUsageEvent(int prompt_tokens, int completion_tokens, std::string* out) const {
  out->append(event_head_);
  absl::StrAppend(out, "\"choices\":[],\"usage\":{\"prompt_tokens\":", prompt_tokens,
                  ",\"completion_tokens\":", completion_tokens,
                  ",\"total_tokens\":", static_cast<int64_t>(prompt_tokens) + completion_tokens, "}}\n\n");
}

void AnswerFormatter::AppendDoneEvent(std::string* out) { out->append("data: [DONE]\n\n"); }

std::string AnswerFormatter::WholeAnswer(absl::string_view text, FinishReason reason, int prompt_tokens,
                                         int completion_tokens, const PrefillKvParams* kv_params) const {
  using nlohmann::ordered_json;
  ordered_json answer;
  answer["id"] = full_id_;
  answer["object"] = api_ == ApiKind::kChat ? "chat.completion" : "text_completion";
  answer["created"] = created_;
  answer["model"] = model_;
  ordered_json choice;
  choice["index"] = 0;
  if (api_ == ApiKind::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", std::string(text)}};
    choice["finish_reason"] = std::string(FinishReasonName(reason));
  } else {
    choice["text"] = std::string(text);
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = std::string(FinishReasonName(reason));
    choice["stop_reason"] = nullptr;
  }
  answer["choices"] = ordered_json::array({std::move(choice)});
  answer["usage"] = {{"prompt_tokens", prompt_tokens},
                     {"completion_tokens", completion_tokens},
                     {"total_tokens", static_cast<int64_t>(prompt_tokens) + completion_tokens}};
  if (kv_params != nullptr) {
    ordered_json kv;
    kv["do_remote_prefill"] = true;
    kv["do_remote_decode"] = false;
    kv["remote_engine_id"] = kv_params->engine_id;
    kv["remote_request_id"] = kv_params->request_id;
    kv["remote_block_ids"] = kv_params->block_ids;
    kv["remote_host"] = kv_params->host;
    kv["remote_port"] = kv_params->port;
    kv["tp_size"] = 1;
    if (kv_params->signature_key == SignatureKey::kEldrExpertCounts ||
        kv_params->signature_key == SignatureKey::kBoth) {
      ordered_json counts;
      counts["layers"] = kv_params->layers;
      counts["experts"] = kv_params->experts;
      counts["encoding"] = "int16_le";
      counts["data"] = kv_params->counts_base64;
      kv["eldr_expert_counts"] = std::move(counts);
    }
    if (kv_params->signature_key == SignatureKey::kEldrSig || kv_params->signature_key == SignatureKey::kBoth) {
      kv["eldr_sig"] = kv_params->counts_base64;
    }
    if (!kv_params->gate_prob_sums_base64.empty()) {
      ordered_json sums;
      sums["layers"] = kv_params->layers;
      sums["experts"] = kv_params->experts;
      sums["encoding"] = "float32_le";
      sums["data"] = kv_params->gate_prob_sums_base64;
      kv["eldr_gate_prob_sums"] = std::move(sums);
    }
    answer["kv_transfer_params"] = std::move(kv);
  }
  // A request id is any bytes a client sent: invalid UTF-8 is replaced rather than thrown on.
  return answer.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

}  // namespace eldr::engine_emu
