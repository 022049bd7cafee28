# Evaluate packaging/homebrew/runspool.rb without Homebrew: just enough of
# the Formula DSL to run the class body and its `service do` block, printed
# as JSON for tests/it/packaging.rs to hold against the launchd plist.
#   ruby tests/packaging/brew_formula.rb packaging/homebrew/runspool.rb
require "json"
require "pathname"

PREFIX = Pathname("/opt/homebrew")

class Formula
  @calls = {}
  class << self
    attr_reader :calls, :service_block

    %i[desc homepage url sha256 license head depends_on].each do |m|
      define_method(m) { |*args, **kw| (@calls[m.to_s] ||= []) << (kw.empty? ? args : args + [kw]) }
    end

    def service(&blk) = (@service_block = blk)
    # Kernel#test would be called otherwise.
    def test(&blk) = (@test_block = blk)
    def inherited(sub)
      super
      sub.instance_variable_set(:@calls, {})
      $formula = sub
    end
  end

  def opt_bin = PREFIX/"opt/runspool/bin"
  def var = PREFIX/"var"
end

# What `service do` may call; anything else is an error, as in Homebrew.
class ServiceRecorder
  attr_reader :fields

  def initialize(formula)
    @formula = formula
    @fields = {}
  end

  def opt_bin = @formula.opt_bin
  def var = @formula.var

  %i[run run_type keep_alive process_type log_path error_log_path working_dir
     environment_variables restart_delay interval nice input_path].each do |m|
    define_method(m) do |*args, **kw|
      @fields[m.to_s] = args.empty? ? kw : (args.length == 1 ? args[0] : args)
    end
  end
end

def plain(v)
  case v
  when Array then v.map { |x| plain(x) }
  when Hash then v.to_h { |k, x| [k.to_s, plain(x)] }
  when Symbol, Pathname then v.to_s
  else v
  end
end

load ARGV.fetch(0)
f = $formula or abort("no Formula subclass in #{ARGV[0]}")
abort("#{f.name} has no service block") unless f.service_block
rec = ServiceRecorder.new(f.new)
rec.instance_exec(&f.service_block)
puts JSON.pretty_generate({
  "class" => f.name,
  "calls" => plain(f.calls),
  "service" => plain(rec.fields),
  "install" => f.instance_methods(false).include?(:install),
})
