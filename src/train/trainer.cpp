#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "core/file.h"
#include "core/progress.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "train/anchors.h"
#include "train/batch_pipeline.h"
#include "train/train_step.h"

namespace dspark {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kEvalSeedMix = 0x6a09e667f3bcc909ull;

std::string state_file_name(long step) { return "training_state-" + std::to_string(step) + ".safetensors"; }

Json data_identity(const Dataset& data) {
  const RegenManifest& manifest = data.manifest();
  return {{"target_id", manifest.target_id},
          {"sequences", data.size()},
          {"tap_layers", manifest.tap_layers},
          {"prompts_fingerprint", manifest.generation.value("prompts_fingerprint", "")}};
}

Json terms_json(const LossTerms& terms) {
  return {{"loss", terms.loss},
          {"ce", terms.ce},
          {"l1", terms.l1},
          {"bce", terms.bce},
          {"tau", terms.tau_estimate},
          {"positions", terms.positions}};
}

// Σ_a Σ_k w_k·mask: the weight of a batch's term means when averaging batches.
double position_weight(const TrainBatch& batch, const LossWeights& weights) {
  double total = 0.0;
  for (int a = 0; a < batch.size(); ++a)
    for (int k = 0; k < batch.gamma; ++k)
      total += std::exp(-double(k) / weights.gamma_decay) * batch.mask[size_t(a) * batch.gamma + k];
  return total;
}

// The fixed held-out anchors every evaluation uses (the same at every step and
// after a resume, so the curve compares like with like).
std::vector<Anchor> evaluation_anchors(const Dataset& data, const std::vector<int>& held_out,
                                       const TrainOptions& options) {
  std::vector<Anchor> anchors;
  if (held_out.empty()) return anchors;
  const AnchorSampler sampler(data, held_out);
  if (sampler.size() <= options.eval_anchors) {
    for (long i = 0; i < sampler.size(); ++i) anchors.push_back(sampler.at(i));
  } else {
    Rng rng(options.seed ^ kEvalSeedMix);
    for (int i = 0; i < options.eval_anchors; ++i) anchors.push_back(sampler.sample(rng));
  }
  return anchors;
}

// `loss` evaluates one batch (TrainStep::evaluate, or drafter_loss on the host).
EvalResult evaluate(const std::function<LossTerms(const TrainBatch&)>& loss, const DrafterConfig& config,
                    const Dataset& data, std::span<const Anchor> anchors, const TrainOptions& options,
                    TrainBatch& batch, ContextRows context_rows) {
  EvalResult result;
  double weight_total = 0.0;
  for (size_t first = 0; first < anchors.size(); first += options.batch) {
    const size_t count = std::min<size_t>(options.batch, anchors.size() - first);
    build_train_batch(data, anchors.subspan(first, count), config.gamma, options.max_context, batch, context_rows);
    const LossTerms terms = loss(batch);
    const double weight = position_weight(batch, options.loss);
    result.terms.loss += terms.loss * weight;
    result.terms.ce += terms.ce * weight;
    result.terms.l1 += terms.l1 * weight;
    result.terms.bce += terms.bce * weight;
    result.terms.tau_estimate += terms.tau_estimate * double(count);
    result.terms.positions += terms.positions;
    weight_total += weight;
  }
  result.anchors = static_cast<int>(anchors.size());
  if (weight_total > 0) {
    result.terms.loss /= weight_total;
    result.terms.ce /= weight_total;
    result.terms.l1 /= weight_total;
    result.terms.bce /= weight_total;
  }
  if (result.anchors > 0) result.terms.tau_estimate /= result.anchors;
  return result;
}

// The log's lines up to and including `step` (a resumed run rewrites what a
// crash left after its checkpoint); a torn last line is dropped.
void truncate_log(const std::filesystem::path& path, long step) {
  if (!std::filesystem::exists(path)) return;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      const Json record = Json::parse(line);
      if (record.value("step", 0L) <= step) kept += line + "\n";
    } catch (const Json::exception&) {
    }
  }
  write_text_file_atomic(path, kept);
}

class LogWriter {
 public:
  explicit LogWriter(const std::filesystem::path& path) : file_(std::fopen(path.c_str(), "a")) {
    DSPARK_CHECK(file_ != nullptr, "cannot append to ", path.string());
  }
  ~LogWriter() { std::fclose(file_); }
  void write(const Json& record) {
    const std::string text = record.dump() + "\n";
    std::fwrite(text.data(), 1, text.size(), file_);
    std::fflush(file_);
  }

 private:
  std::FILE* file_;
};

void save_checkpoint(const Drafter& drafter, const AdamW& optimizer, long step, const TrainOptions& options,
                     const Json& data, double best_tau, long best_step, const std::filesystem::path& output) {
  save_drafter(drafter, output);
  std::vector<SafetensorsWriteEntry> entries;
  for (const std::string& name : drafter.names) {
    const Tensor& parameter = drafter.parameter(name);
    entries.push_back({"param/" + name, Dtype::F32, parameter.shape, parameter.data});
    entries.push_back({"adam_m/" + name, Dtype::F32, parameter.shape, optimizer.first_moments().at(name).data});
    entries.push_back({"adam_v/" + name, Dtype::F32, parameter.shape, optimizer.second_moments().at(name).data});
  }
  const std::string file = state_file_name(step);
  write_safetensors(output / file, entries, {{"format", "dspark-training-state"}, {"step", std::to_string(step)}});
  const Json previous = read_training_state(output);
  const Json state = {{"kind", "dspark-training-state"},
                      {"version", 1},
                      {"step", step},
                      {"optimizer_steps", optimizer.steps()},
                      {"state_file", file},
                      {"iterations", options.iterations},
                      {"options", train_options_to_json(options)},
                      {"decayed", optimizer.decayed()},
                      {"data", data},
                      {"best", {{"tau", best_tau}, {"step", best_step}}},
                      {"rng", {{"kind", "per-step streams"}, {"seed", options.seed}, {"next_step", step}}}};
  write_text_file_atomic(output / kTrainingStateFile, state.dump(2) + "\n");
  if (!previous.is_null() && previous.value("state_file", "") != file)
    std::filesystem::remove(output / previous.value("state_file", ""));
}

void restore_checkpoint(Drafter& drafter, AdamW& optimizer, const Json& state, const std::filesystem::path& output) {
  const std::filesystem::path path = output / json_get<std::string>(state, "state_file", kTrainingStateFile);
  const SafetensorsFile file(path);
  TensorMap first, second;
  for (const std::string& name : drafter.names) {
    Tensor& parameter = drafter.parameters.at(name);
    auto load = [&](const std::string& key) {
      DSPARK_CHECK(file.contains(key), path.string(), ": missing tensor \"", key, "\"");
      DSPARK_CHECK(file.entry(key).shape == parameter.shape, path.string(), ": \"", key, "\" has shape ",
                   shape_string(file.entry(key).shape), ", the drafter's is ", shape_string(parameter.shape));
      Tensor stored = file.load_f32(key), owned = Tensor::zeros(parameter.shape);
      std::copy_n(stored.data, stored.numel(), owned.data);
      return owned;
    };
    const Tensor weights = load("param/" + name);
    std::copy_n(weights.data, weights.numel(), parameter.data);
    first.emplace(name, load("adam_m/" + name));
    second.emplace(name, load("adam_v/" + name));
  }
  optimizer.restore(json_get<long>(state, "optimizer_steps", kTrainingStateFile), first, second);
}

std::string format_terms(const LossTerms& terms) {
  char text[160];
  std::snprintf(text, sizeof text, "loss %.4f (ce %.3f l1 %.3f bce %.3f) tau^ %.3f", terms.loss, terms.ce, terms.l1,
                terms.bce, terms.tau_estimate);
  return text;
}

// The step of options.device over `drafter` and `optimizer` (their current state).
std::unique_ptr<TrainStep> make_train_step(Drafter& drafter, const TargetHead& head, AdamW& optimizer,
                                           const TrainOptions& options) {
  if (options.device == "cpu") return make_cpu_train_step(drafter, head, &optimizer);
  DSPARK_CHECK(options.device == "cuda", "unknown training device \"", options.device, "\" (cpu or cuda)");
#ifdef DSPARK_CUDA
  return make_cuda_train_step(drafter, head, optimizer);
#else
  fail("--device cuda: this build has no CUDA support (nvcc was not found at build time)");
#endif
}

}  // namespace

EvalResult evaluate_drafter(const Drafter& drafter, const TargetHead& head, const Dataset& data,
                            std::span<const Anchor> anchors, const TrainOptions& options) {
  TrainBatch batch;
  LossWorkspace workspace;
  auto loss = [&](const TrainBatch& b) { return drafter_loss(drafter, head, b, options.loss, nullptr, workspace); };
  return evaluate(loss, drafter.config, data, anchors, options, batch, ContextRows::F32);
}

Json train_options_to_json(const TrainOptions& o) {
  return {{"batch", o.batch},
          {"max_context", o.max_context},
          {"learning_rate", o.learning_rate},
          {"warmup", o.warmup},
          {"final_lr_fraction", o.final_lr_fraction},
          {"adamw",
           {{"beta1", o.adamw.beta1},
            {"beta2", o.adamw.beta2},
            {"epsilon", o.adamw.epsilon},
            {"weight_decay", o.adamw.weight_decay}}},
          {"clip_norm", o.clip_norm},
          {"loss", {{"ce", o.loss.ce}, {"l1", o.loss.l1}, {"bce", o.loss.bce}, {"gamma_decay", o.loss.gamma_decay}}},
          {"seed", o.seed},
          {"held_out_fraction", o.held_out_fraction},
          {"eval_anchors", o.eval_anchors}};
}

TrainOptions train_options_from_json(const Json& json, TrainOptions o) {
  const std::string where = "training options";
  o.batch = json_get_or(json, "batch", o.batch, where);
  o.max_context = json_get_or(json, "max_context", o.max_context, where);
  o.learning_rate = json_get_or(json, "learning_rate", o.learning_rate, where);
  o.warmup = json_get_or(json, "warmup", o.warmup, where);
  o.final_lr_fraction = json_get_or(json, "final_lr_fraction", o.final_lr_fraction, where);
  if (json.contains("adamw")) {
    const Json& adamw = json["adamw"];
    o.adamw.beta1 = json_get_or(adamw, "beta1", o.adamw.beta1, where);
    o.adamw.beta2 = json_get_or(adamw, "beta2", o.adamw.beta2, where);
    o.adamw.epsilon = json_get_or(adamw, "epsilon", o.adamw.epsilon, where);
    o.adamw.weight_decay = json_get_or(adamw, "weight_decay", o.adamw.weight_decay, where);
  }
  o.clip_norm = json_get_or(json, "clip_norm", o.clip_norm, where);
  if (json.contains("loss")) {
    const Json& loss = json["loss"];
    o.loss.ce = json_get_or(loss, "ce", o.loss.ce, where);
    o.loss.l1 = json_get_or(loss, "l1", o.loss.l1, where);
    o.loss.bce = json_get_or(loss, "bce", o.loss.bce, where);
    o.loss.gamma_decay = json_get_or(loss, "gamma_decay", o.loss.gamma_decay, where);
  }
  o.seed = json_get_or(json, "seed", o.seed, where);
  o.held_out_fraction = json_get_or(json, "held_out_fraction", o.held_out_fraction, where);
  o.eval_anchors = json_get_or(json, "eval_anchors", o.eval_anchors, where);
  return o;
}

Json read_training_state(const std::filesystem::path& output) {
  const std::filesystem::path path = output / kTrainingStateFile;
  if (!std::filesystem::exists(path)) return nullptr;
  return read_json_file(path);
}

TrainSummary train_drafter(Drafter& drafter, const TargetHead& head, const Dataset& data, const TrainOptions& options,
                           const std::filesystem::path& output, bool resume) {
  const auto start_time = Clock::now();
  DSPARK_CHECK(options.iterations >= 1 && options.batch >= 1 && options.max_context >= 1 && options.eval_anchors >= 1 &&
                   options.warmup >= 0,
               "training needs iterations, batch, max context and eval anchors >= 1 and warmup >= 0");
  DSPARK_CHECK(options.learning_rate > 0 && options.clip_norm > 0,
               "training needs a positive learning rate and clip norm");
  DSPARK_CHECK(
      drafter.dims.hidden_size == data.hidden_size() && drafter.config.tap_layers == data.manifest().tap_layers,
      "the drafter's hidden size and tap layers must be the data's (", data.hidden_size(), ")");
  DSPARK_CHECK(drafter.dims.vocab_size == data.manifest().vocab_size, "the drafter's vocabulary (",
               drafter.dims.vocab_size, ") is not the data's (", data.manifest().vocab_size, ")");

  const DatasetSplit split = split_dataset(data.size(), options.held_out_fraction);
  const AnchorSampler sampler(data, split.train);
  DSPARK_CHECK(sampler.size() > 0, "the training split has no anchors (", data.size(), " sequences, ",
               split.held_out.size(), " held out)");
  const std::vector<Anchor> eval_anchors = evaluation_anchors(data, split.held_out, options);
  const Json identity = data_identity(data);

  std::vector<std::string> decays;
  for (const std::string& name : drafter.names)
    if (drafter_parameter_decays(name, drafter.parameter(name).shape)) decays.push_back(name);
  AdamW optimizer(drafter.parameters, decays, options.adamw);
  const LearningRateSchedule schedule{options.learning_rate, options.warmup, options.iterations,
                                      options.final_lr_fraction};

  TrainSummary summary;
  std::filesystem::create_directories(output);
  const Json existing = read_training_state(output);
  long step = 0;
  if (resume) {
    DSPARK_CHECK(!existing.is_null(), "nothing to resume: ", (output / kTrainingStateFile).string(), " does not exist");
    const Json stored = existing.value("options", Json::object()), given = train_options_to_json(options);
    for (const auto& [key, value] : given.items())
      DSPARK_CHECK(stored.contains(key) && stored[key] == value, "--resume: ", key, " is ", value.dump(),
                   " but the run being resumed used ", stored.contains(key) ? stored[key].dump() : "(unset)");
    DSPARK_CHECK(existing.value("data", Json::object()) == identity, "--resume: the data is not the data the run ",
                 "was started with (", existing.value("data", Json::object()).dump(), ")");
    restore_checkpoint(drafter, optimizer, existing, output);
    step = json_get<long>(existing, "step", kTrainingStateFile);
    summary.best_tau = existing["best"].value("tau", 0.0);
    summary.best_step = existing["best"].value("step", -1L);
    truncate_log(output / kTrainLogFile, step);
  } else {
    DSPARK_CHECK(existing.is_null(), output.string(),
                 " already holds a training run (pass --resume to continue it, or choose a new output directory)");
    std::filesystem::remove(output / kTrainLogFile);
  }
  summary.start_step = step;
  summary.evaluated = !eval_anchors.empty();
  if (!summary.evaluated)
    std::fprintf(stderr,
                 "warning: no held-out sequences (%d in the data): tau^ is not evaluated and best/ is not "
                 "written\n",
                 data.size());

  const std::unique_ptr<TrainStep> stepper = make_train_step(drafter, head, optimizer, options);
  // The GPU takes the data's bf16 rows as they are stored.
  const ContextRows context_rows = options.device == "cuda" ? ContextRows::Bf16 : ContextRows::F32;
  // Batches packed and copied while the previous step runs, where the step takes them (destroyed
  // before the step, whose staging it packs into). It starts now: the first batches are packed
  // while the first evaluation runs.
  BatchStaging* staging = options.prefetch ? stepper->batch_staging() : nullptr;
  std::unique_ptr<BatchPipeline> pipeline;
  if (staging && step < options.iterations) {
    BatchPipeline::Options pipeline_options;
    pipeline_options.seed = options.seed;
    pipeline_options.batch = options.batch;
    pipeline_options.gamma = drafter.config.gamma;
    pipeline_options.max_context = options.max_context;
    pipeline_options.first_step = step;
    pipeline_options.end_step = options.iterations;
    pipeline = std::make_unique<BatchPipeline>(data, sampler, pipeline_options, *staging);
  }
  LogWriter log(output / kTrainLogFile);
  TrainBatch batch;
  std::vector<Anchor> anchors(options.batch);

  auto run_evaluation = [&](long at_step) {
    if (!summary.evaluated) return;
    const EvalResult result = evaluate([&](const TrainBatch& b) { return stepper->evaluate(b, options.loss); },
                                       drafter.config, data, eval_anchors, options, batch, context_rows);
    if (at_step == summary.start_step) summary.first_eval = result;
    summary.last_eval = result;
    Json record = terms_json(result.terms);
    record["step"] = at_step;
    record["split"] = "held_out";
    record["anchors"] = result.anchors;
    log.write(record);
    if (result.terms.tau_estimate > summary.best_tau || summary.best_step < 0) {
      summary.best_tau = result.terms.tau_estimate;
      summary.best_step = at_step;
      stepper->store(drafter, optimizer);
      save_drafter(drafter, output / "best");
    }
  };
  auto checkpoint = [&](long at_step) {
    stepper->store(drafter, optimizer);
    save_checkpoint(drafter, optimizer, at_step, options, identity, summary.best_tau, summary.best_step, output);
  };

  if (step == 0) run_evaluation(0);
  Progress progress("train", options.iterations - step, "steps");
  long positions_total = 0;
  double step_seconds_total = 0.0;
  bool stopped = false;
  while (step < options.iterations && !stopped) {
    const auto step_start = Clock::now();
    const double learning_rate = schedule.at(step);
    TrainStep::Result update;
    if (pipeline) {
      update = stepper->train_packed(pipeline->next(), options.loss, options.clip_norm, learning_rate);
    } else {
      sample_step_anchors(sampler, options.seed, step, anchors);
      build_train_batch(data, anchors, drafter.config.gamma, options.max_context, batch, context_rows);
      update = stepper->train(batch, options.loss, options.clip_norm, learning_rate);
    }
    const LossTerms& terms = update.terms;
    DSPARK_CHECK(std::isfinite(terms.loss), "the training loss is not finite at step ", step + 1,
                 " (try a lower --lr)");
    const double gradient_norm = update.gradient_norm;
    ++step;
    const double seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    positions_total += terms.positions;
    step_seconds_total += seconds;
    summary.last_train = terms;

    Json record = terms_json(terms);
    record["step"] = step;
    record["split"] = "train";
    record["lr"] = learning_rate;
    record["grad_norm"] = gradient_norm;
    record["tokens_per_s"] = seconds > 0 ? terms.positions / seconds : 0.0;
    log.write(record);

    stopped = step == options.stop_after || (options.interrupted && options.interrupted());
    const bool last = step == options.iterations;
    if ((options.eval_every > 0 && step % options.eval_every == 0) || last) run_evaluation(step);
    if ((options.save_every > 0 && step % options.save_every == 0) || last || stopped) checkpoint(step);
    if (options.show_progress) {
      char held_out[48] = "", rate[32];
      if (summary.evaluated)
        std::snprintf(held_out, sizeof held_out, ", held-out tau^ %.3f", summary.last_eval.terms.tau_estimate);
      std::snprintf(rate, sizeof rate, ", %.0f tokens/s",
                    step_seconds_total > 0 ? positions_total / step_seconds_total : 0.0);
      const std::string detail = format_terms(terms) + held_out + rate;
      progress.update(step - summary.start_step, detail);
      if (last) progress.finish(detail);
    }
  }
  if (stopped && step < options.iterations)
    std::fprintf(stderr, "stopped at step %ld of %ld; checkpoint saved (continue with --resume)\n", step,
                 options.iterations);
  stepper->store(drafter, optimizer);  // the drafter trained in place
  summary.steps = step;
  summary.finished = step == options.iterations;
  summary.seconds = std::chrono::duration<double>(Clock::now() - start_time).count();
  summary.positions_per_second = step_seconds_total > 0 ? positions_total / step_seconds_total : 0.0;
  return summary;
}

}  // namespace dspark
