#include "core/config.h"

#include <boost/program_options.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace po = boost::program_options;

namespace moeut {
namespace {

[[noreturn]] void fail(const std::string& option, const std::string& rule) {
  throw ConfigError("invalid configuration: " + option + ": " + rule);
}

void require_positive(const char* name, int64_t v) {
  if (v <= 0) fail(name, "must be positive (got " + std::to_string(v) + ")");
}

void require_range(const char* name, double v, double lo, double hi, const char* rule) {
  if (!std::isfinite(v) || v < lo || v > hi) fail(name, std::string(rule) + " (got " + std::to_string(v) + ")");
}

po::options_description model_options(ModelConfig& m) {
  po::options_description o("Model (names as the official MoEUT constructor)");
  o.add_options()
      ("n_tokens", po::value(&m.n_tokens)->default_value(m.n_tokens), "vocabulary size V")
      ("d_model", po::value(&m.d_model)->default_value(m.d_model), "residual width d")
      ("n_layers", po::value(&m.n_layers)->default_value(m.n_layers), "logical layers L")
      ("group_size", po::value(&m.group_size)->default_value(m.group_size), "physical layers G (shared across depth)")
      ("n_heads", po::value(&m.n_heads)->default_value(m.n_heads), "attention heads H")
      ("d_head", po::value(&m.d_head)->default_value(m.d_head), "head width dh")
      ("att_n_experts", po::value(&m.att_n_experts)->default_value(m.att_n_experts), "attention experts per head")
      ("att_k", po::value(&m.att_k)->default_value(m.att_k), "attention experts chosen per head")
      ("ff_n_experts", po::value(&m.ff_n_experts)->default_value(m.ff_n_experts), "FFN experts")
      ("ff_k", po::value(&m.ff_k)->default_value(m.ff_k), "FFN experts chosen per token")
      ("ff_expert_size", po::value(&m.ff_expert_size)->default_value(m.ff_expert_size), "FFN expert width")
      ("entropy_reg", po::value(&m.entropy_reg)->default_value(m.entropy_reg), "FFN routing entropy coefficient")
      ("att_entropy_reg", po::value(&m.att_entropy_reg)->default_value(m.att_entropy_reg), "attention routing entropy coefficient")
      ("context", po::value(&m.context)->default_value(m.context), "sequence length T");
  return o;
}

po::options_description train_options(TrainConfig& t) {
  po::options_description o("Training");
  o.add_options()
      ("train_data", po::value(&t.train_data), "training token file, or a comma-separated list and/or glob of them read as one stream (docs/DATA.md)")
      ("val_data", po::value(&t.val_data), "validation token file(s), as train_data")
      ("out_weights", po::value(&t.out_weights)->default_value(t.out_weights),
       "HDF5 weights written at the end (none: no weights file, as for a benchmark)")
      ("metrics", po::value(&t.metrics)->default_value(t.metrics), "JSON-lines metrics file")
      ("steps", po::value(&t.steps)->default_value(t.steps), "optimizer steps")
      ("batch_size", po::value(&t.batch_size)->default_value(t.batch_size), "global batch in sequences")
      ("micro_batch_size", po::value(&t.micro_batch_size)->default_value(t.micro_batch_size), "sequences per forward/backward")
      ("lr", po::value(&t.lr)->default_value(t.lr), "peak learning rate")
      ("min_lr_ratio", po::value(&t.min_lr_ratio)->default_value(t.min_lr_ratio), "final lr as a fraction of lr (cosine)")
      ("warmup_steps", po::value(&t.warmup_steps)->default_value(t.warmup_steps), "linear warm-up steps")
      ("weight_decay", po::value(&t.weight_decay)->default_value(t.weight_decay), "AdamW weight decay")
      ("adam_beta1", po::value(&t.adam_beta1)->default_value(t.adam_beta1), "AdamW beta1")
      ("adam_beta2", po::value(&t.adam_beta2)->default_value(t.adam_beta2), "AdamW beta2")
      ("adam_eps", po::value(&t.adam_eps)->default_value(t.adam_eps), "AdamW epsilon")
      ("grad_clip", po::value(&t.grad_clip)->default_value(t.grad_clip), "global gradient-norm clip (0: off)")
      ("grad_jump_factor", po::value(&t.grad_jump_factor)->default_value(t.grad_jump_factor),
       "report each tensor's gradient norm at a step whose norm exceeds this multiple of the recent median (0: off)")
      ("seed", po::value(&t.seed)->default_value(t.seed), "seed of initialisation and data order")
      ("eval_every", po::value(&t.eval_every)->default_value(t.eval_every), "steps between validation reports (0: off)")
      ("eval_batches", po::value(&t.eval_batches)->default_value(t.eval_batches), "validation micro-batches per periodic report")
      ("log_experts_every", po::value(&t.log_experts_every)->default_value(t.log_experts_every),
       "steps between expert-load reports: selections per expert, dead experts, usage perplexity (0: off)")
      ("threads", po::value(&t.threads)->default_value(t.threads), "CPU threads (0: OpenMP default)")
      ("ep", po::value(&t.ep)->default_value(t.ep), "expert-parallel group size: ranks that share one copy of the FFN experts")
      ("device", po::value(&t.device)->default_value(t.device), "cpu, cuda, or auto (cuda when a GPU is present)")
      ("dispatcher", po::value(&t.dispatcher)->default_value(t.dispatcher),
       "expert-parallel token dispatch: all_to_all (copies to the ranks that need them), all_gather (every token "
       "to every rank of the group), or auto (all_gather on GPU ranks whose expert-parallel groups each lie on one "
       "machine, all_to_all otherwise)")
      ("checkpoint_dir", po::value(&t.checkpoint_dir), "directory of sharded checkpoints (step_<N>/); none when empty")
      ("checkpoint_every", po::value(&t.checkpoint_every)->default_value(t.checkpoint_every),
       "steps between checkpoints (0: only at the end)")
      ("keep_checkpoints", po::value(&t.keep_checkpoints)->default_value(t.keep_checkpoints),
       "newest checkpoints kept in checkpoint_dir (0: all)")
      ("resume", po::value(&t.resume),
       "continue from a checkpoint: a step_<N> directory, latest (the newest in checkpoint_dir), or auto (the newest, "
       "or a fresh start when there is none)")
      ("init_weights", po::value(&t.init_weights),
       "start from this interchange weights file (moeut-export, moeut-torch to-h5) with fresh optimizer state; with "
       "--resume auto, a checkpoint found in checkpoint_dir wins")
      ("discard_newer_checkpoints", po::bool_switch(&t.discard_newer_checkpoints),
       "with --resume of an older step_<N>: delete the checkpoints of checkpoint_dir beyond it (else refused)")
      ("time_limit", po::value(&t.time_limit)->default_value(t.time_limit),
       "wall-clock seconds the steps may take from the first: a checkpoint is saved and the run stops (exit status "
       "75) before them (0: none)")
      ("hang_timeout", po::value(&t.hang_timeout)->default_value(t.hang_timeout),
       "seconds a rank may wait in one collective before the run ends naming the rank, group and operation "
       "(exit status 4; 0: off)");
  return o;
}

// The file's text: a readable regular file (not a directory, not a device such as /dev/zero) of
// text (no NUL byte) whose lines are no longer than an option value may be.
std::string read_config_text(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) throw ConfigError("config file '" + shown(path) + "': cannot read it: " + ec.message());
  if (status.type() != std::filesystem::file_type::regular)
    throw ConfigError("config file '" + shown(path) + "': not a regular file (" +
                      (status.type() == std::filesystem::file_type::directory ? "a directory" : "a device, pipe or socket") +
                      "); give a profile file such as configs/tiny.cfg");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (!in || !(text << in.rdbuf())) throw ConfigError("config file '" + shown(path) + "': cannot read it");
  const std::string s = text.str();
  if (const size_t nul = s.find('\0'); nul != std::string::npos)
    throw ConfigError("config file '" + shown(path) + "': not a text file (byte " + std::to_string(nul) + " is NUL)");
  size_t line = 1;
  for (size_t begin = 0; begin < s.size(); ++line) {
    const size_t end = std::min(s.find('\n', begin), s.size());
    if (end - begin > kLongestOptionValue)
      throw ConfigError("config file '" + shown(path) + "': line " + std::to_string(line) + " ('" +
                        shown(s.substr(begin, end - begin)) + "') is longer than " +
                        std::to_string(kLongestOptionValue) + " characters");
    begin = end + 1;
  }
  return s;
}

void parse_file(const std::string& path, const po::options_description& desc, po::variables_map& vm) {
  std::istringstream in(read_config_text(path));
  try {
    po::store(po::parse_config_file(in, desc), vm);
  } catch (const po::error& e) {
    throw ConfigError("config file '" + shown(path) + "': " + e.what());
  }
}

}  // namespace

std::string shown(const std::string& value) {
  constexpr size_t kShown = 200;
  if (value.size() <= kShown) return value;
  return value.substr(0, kShown) + "... (" + std::to_string(value.size()) + " characters in all)";
}

void validate(const ModelConfig& m) {
  require_positive("n_tokens", m.n_tokens);
  require_positive("d_model", m.d_model);
  require_positive("n_layers", m.n_layers);
  require_positive("group_size", m.group_size);
  require_positive("n_heads", m.n_heads);
  require_positive("d_head", m.d_head);
  require_positive("att_n_experts", m.att_n_experts);
  require_positive("att_k", m.att_k);
  require_positive("ff_n_experts", m.ff_n_experts);
  require_positive("ff_k", m.ff_k);
  require_positive("ff_expert_size", m.ff_expert_size);
  require_positive("context", m.context);
  if (m.n_tokens > (int64_t(1) << 31) - 1) fail("n_tokens", "must fit a 32-bit token id");
  if (m.n_layers % m.group_size != 0)
    fail("n_layers", "must be divisible by group_size (" + std::to_string(m.n_layers) + " % " +
                         std::to_string(m.group_size) + " != 0)");
  // With one expert the official constructor builds another attention (dense v [H·dh, d] and o
  // [d, H·dh], no sel_v, a sigmoid output gate, no value routing), which this project does not.
  if (m.att_n_experts == 1)
    fail("att_n_experts", "must be at least 2: with one attention expert the official MoEUTLM builds a dense "
                          "attention with a sigmoid output gate (no sel_v), which this project does not implement");
  if (m.att_k > m.att_n_experts)
    fail("att_k", "must not exceed att_n_experts (" + std::to_string(m.att_k) + " > " + std::to_string(m.att_n_experts) + ")");
  if (m.ff_k > m.ff_n_experts)
    fail("ff_k", "must not exceed ff_n_experts (" + std::to_string(m.ff_k) + " > " + std::to_string(m.ff_n_experts) + ")");
  if (m.rope_dims() < 2)
    fail("d_head", "must be at least 4, so that RoPE rotates an even number (>= 2) of dimensions (got " +
                       std::to_string(m.d_head) + ")");
  require_range("entropy_reg", m.entropy_reg, 0, INFINITY, "must be finite and >= 0");
  require_range("att_entropy_reg", m.att_entropy_reg, 0, INFINITY, "must be finite and >= 0");
}

void validate(const Config& c) {
  validate(c.model);
  const TrainConfig& t = c.train;
  require_positive("steps", t.steps);
  require_positive("batch_size", t.batch_size);
  require_positive("micro_batch_size", t.micro_batch_size);
  if (t.batch_size % t.micro_batch_size != 0)
    fail("batch_size", "must be a multiple of micro_batch_size (" + std::to_string(t.batch_size) + " % " +
                           std::to_string(t.micro_batch_size) + " != 0)");
  require_range("lr", t.lr, 1e-300, INFINITY, "must be finite and > 0");
  require_range("min_lr_ratio", t.min_lr_ratio, 0, 1, "must be in [0, 1]");
  if (t.warmup_steps < 0) fail("warmup_steps", "must be >= 0");
  require_range("weight_decay", t.weight_decay, 0, INFINITY, "must be finite and >= 0");
  require_range("adam_beta1", t.adam_beta1, 0, 0.999999999, "must be in [0, 1)");
  require_range("adam_beta2", t.adam_beta2, 0, 0.999999999, "must be in [0, 1)");
  require_range("adam_eps", t.adam_eps, 1e-300, INFINITY, "must be finite and > 0");
  require_range("grad_clip", t.grad_clip, 0, INFINITY, "must be finite and >= 0 (0 disables clipping)");
  if (t.grad_jump_factor != 0) require_range("grad_jump_factor", t.grad_jump_factor, 1, INFINITY, "must be 0 (off) or finite and >= 1");
  if (t.eval_every < 0) fail("eval_every", "must be >= 0 (0 disables)");
  if (t.log_experts_every < 0) fail("log_experts_every", "must be >= 0 (0 disables)");
  require_positive("eval_batches", t.eval_batches);
  if (t.threads < 0) fail("threads", "must be >= 0 (0: OpenMP default)");
  // A thread per hardware thread is the most that helps; more only contend (and enough of them
  // exhaust the process's stacks). 0: the machine does not say how many it has.
  if (const unsigned machine = std::thread::hardware_concurrency(); machine > 0 && t.threads > int64_t(machine))
    fail("threads", "must be at most the machine's " + std::to_string(machine) + " hardware threads (got " +
                        std::to_string(t.threads) + ")");
  require_positive("ep", t.ep);
  if (t.dispatcher != "all_to_all" && t.dispatcher != "all_gather" && t.dispatcher != "auto")
    fail("dispatcher", "must be all_to_all, all_gather or auto (got '" + shown(t.dispatcher) + "')");
  if (t.device != "cpu" && t.device != "cuda" && t.device != "auto")
    fail("device", "must be cpu, cuda or auto (got '" + shown(t.device) + "')");
  if (t.train_data.empty()) fail("train_data", "is required");
  if (t.val_data.empty()) fail("val_data", "is required");
  if (t.out_weights.empty()) fail("out_weights", "must not be empty");
  if (t.checkpoint_every < 0) fail("checkpoint_every", "must be >= 0 (0: only at the end)");
  if (t.keep_checkpoints < 0) fail("keep_checkpoints", "must be >= 0 (0: keep all)");
  if (t.checkpoint_dir.empty() && (t.checkpoint_every > 0 || t.keep_checkpoints > 0))
    fail(t.checkpoint_every > 0 ? "checkpoint_every" : "keep_checkpoints", "needs checkpoint_dir");
  if ((t.resume == "latest" || t.resume == "auto") && t.checkpoint_dir.empty())
    fail("resume", t.resume + " needs checkpoint_dir");
  if (!t.init_weights.empty() && !t.resume.empty() && t.resume != "auto")
    fail("init_weights", "cannot go with --resume " + shown(t.resume) +
                             ": the checkpoint holds the weights (--resume auto starts from init_weights while "
                             "checkpoint_dir has no checkpoint, and resumes once it has)");
  require_range("time_limit", t.time_limit, 0, INFINITY, "must be finite and >= 0 (0: no limit)");
  require_range("hang_timeout", t.hang_timeout, 0, INFINITY, "must be finite and >= 0 (0: off)");
}

bool parse_train_args(int argc, const char* const* argv, Config& out) {
  Config c;
  std::string config_path;
  po::options_description general("General");
  general.add_options()("help,h", "show this help")("config", po::value(&config_path), "profile file, e.g. configs/tiny.cfg");
  po::options_description file_options;
  file_options.add(model_options(c.model)).add(train_options(c.train));
  po::options_description all;
  all.add(general).add(file_options);
  for (int i = 1; i < argc; ++i)
    if (const std::string arg = argv[i]; arg.size() > kLongestOptionValue)
      throw ConfigError("command line: argument " + std::to_string(i) + " ('" + shown(arg) + "') is longer than " +
                        std::to_string(kLongestOptionValue) + " characters");
  po::variables_map vm;
  try {
    // The command line is stored first: Boost keeps the first value it sees, so it overrides
    // the file.
    po::store(po::parse_command_line(argc, argv, all), vm);
    if (vm.count("help")) {
      std::cout << "usage: " << argv[0] << " [--config FILE] [--option value ...]\n" << all << "\n";
      return false;
    }
    if (vm.count("config")) parse_file(vm["config"].as<std::string>(), file_options, vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError(std::string("command line: ") + e.what());
  }
  validate(c);
  out = c;
  return true;
}

Config load_config_file(const std::string& path) {
  Config c;
  po::options_description file_options;
  file_options.add(model_options(c.model)).add(train_options(c.train));
  po::variables_map vm;
  parse_file(path, file_options, vm);
  po::notify(vm);
  validate(c.model);
  return c;
}

}  // namespace moeut
